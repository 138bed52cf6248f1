"""Everything one rank trains with, built from the launcher's arguments on megatron-core.

The model is cut by the schedule's placement (V puts the embedding and the loss on rank 0)
and initialised per layer, not per rank, so the same ``--seed`` gives the same model under
every schedule, pipeline and tensor-parallel size: runs can be compared loss for loss.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy
import torch

from .moe_checks import MOE_ONLY

# Flags copied under their own names, as Megatron-LM's core_*_config_from_args do.
TRANSFORMER_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "sequence_parallel", "hidden_dropout", "attention_dropout",
    "init_method_std", "fp16", "bf16", "kv_channels", "normalization", "layernorm_epsilon",
    "layernorm_zero_centered_gamma", "add_bias_linear", "qk_layernorm", "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)  # fmt: skip
OPTIMIZER_FIELDS = (
    "optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "fp16",
    "bf16", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
    "use_distributed_optimizer",
)  # fmt: skip


def _same_names(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names}


@dataclass
class Trainee:
    config: object  # TransformerConfig
    chunks: list  # DDP-wrapped model chunks, in chunk order
    optimizer: object  # megatron-core ChainedOptimizer
    scheduler: object  # OptimizerParamScheduler
    device: torch.device
    validation: object = None  # PostValidation of the optimizer, with --enable-optimizer-post-validation


def init_parallel(args: argparse.Namespace, device: torch.device) -> None:
    from megatron.core import parallel_state, tensor_parallel

    from ..megatron.gpt_model import embedding_ranks

    chunks = sum(placement.chunks for placement in args.placements)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        get_embedding_ranks=embedding_ranks(args.placement),
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    seed = pipeline_rank_seed(args.seed, parallel_state.get_pipeline_model_parallel_rank())
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        # Attention forks megatron's model-parallel RNG even without dropout; on CPU the
        # shims install a no-op tracker instead.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def pipeline_rank_seed(seed: int, pipeline_rank: int) -> int:
    """Megatron-LM's ``_set_random_seed``: each pipeline stage draws (dropout) from ``seed + 100 x rank``.

    The initial weights do not come from it: ``placement_independent_init`` draws each
    parameter from (--seed, its name), so every schedule and placement starts from one model.
    """
    return seed + 100 * pipeline_rank


def transformer_config(args: argparse.Namespace, gloo: bool):
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    chunks = sum(placement.chunks for placement in args.placements)
    config = TransformerConfig(
        **_same_names(args, TRANSFORMER_FIELDS),
        **_derived_fields(args),
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        pipeline_model_parallel_layout=_layout(args),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        deallocate_pipeline_outputs=True,
        batch_p2p_sync=not gloo,
        gradient_accumulation_fusion=False,
    )
    return config


def _derived_fields(args: argparse.Namespace) -> dict:
    """The fields Megatron-LM's core_transformer_config_from_args (and validate_args) derive from the model flags.

    Bias-activation fusion stays off, as it is for GELU here: the launcher has no fusion flags,
    and the unfused SwiGLU is the one every schedule and the CPU tests run.
    """
    fields = {
        "num_query_groups": args.num_query_groups if args.group_query_attention else None,
        "add_qkv_bias": args.add_qkv_bias or args.add_bias_linear,  # validate_args keeps the two in sync
    }
    if args.swiglu:
        fields.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    if args.num_experts:
        fields.update(_same_names(args, MOE_ONLY), num_moe_experts=args.num_experts)
    if getattr(args, "mtp_num_layers", None):
        fields.update(mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    return fields


def layer_spec(args: argparse.Namespace):
    """megatron-core's local layer spec with the flags' norm and q/k normalisation, as Megatron-LM's gpt_builders.

    With experts, megatron-core's decoder block spec, built per chunk (``block_spec_for``): each layer
    dense or MoE as --moe-layer-freq says, its experts SequentialMLP (the local spec's).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if args.num_experts:
        from ..megatron.gpt_model import block_spec_for

        return block_spec_for(args.normalization)
    return get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)


def rotary_settings(args: argparse.Namespace) -> dict:
    """GPTModel's RoPE arguments (it ignores them for other position embeddings).

    Megatron-LM's pretrain_gpt does not pass ``rope_scaling_factor`` on (0.16 to 0.19: the
    factor stays 8 whatever the flag says); here the flag is applied.
    """
    return {
        "rotary_percent": args.rotary_percent,
        "rotary_base": args.rotary_base,
        "rope_scaling": args.use_rope_scaling,
        "rope_scaling_factor": args.rope_scaling_factor,
    }


def _layout(args: argparse.Namespace):
    """Our layout where megatron's own split differs (V, padding); megatron's otherwise."""
    from ..megatron.layout import layer_layout

    if len(args.placements) > 1:
        return None  # several pipes: each gets its own layout (build_pipes)
    if not args.placement.megatron_builds or args.allow_padding_num_layers:
        return layer_layout(
            args.num_layers, args.placement, args.allow_padding_num_layers, getattr(args, "mtp_num_layers", None)
        )
    return None


def build(args: argparse.Namespace, device: torch.device, gloo: bool) -> Trainee:
    """Model chunks (initialised, wrapped, on ``device``), optimizer and LR schedule for this rank."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from ..megatron.gpt_model import build_pipes, float16_chunks, tied_embedding_finalize
    from ..megatron.init import placement_independent_init

    config = transformer_config(args, gloo)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = build_pipes(
        config,
        args.placements,
        rank,
        shared=args.zero_bubble.shared if args.zero_bubble is not None else (),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        layer_spec=layer_spec(args),
        **rotary_settings(args),
    )
    placement_independent_init(chunks, config, args.seed)
    chunks = [chunk.to(device) for chunk in chunks]
    if args.fp16 or args.bf16:
        wrapped, offset = [], 0
        for placement in args.placements:  # each pipe's chunks, after the pipes before it
            wrapped += float16_chunks(config, chunks[offset : offset + placement.chunks], placement, rank)
            offset += placement.chunks
        chunks = wrapped
    if getattr(args, "zero_bubble_order_independent_dropout", False):
        from ..megatron.dropout_keys import install

        install(chunks, args.seed)
    if args.use_torch_fsdp2:
        return _build_zero3(args, config, chunks, device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    chunks = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    # As Megatron-LM: a list per chunk, a plain function with one chunk (megatron-core's
    # non-interleaved schedule calls it directly).
    config.no_sync_func = _per_chunk([chunk.no_sync for chunk in chunks])
    if args.overlap_grad_reduce:
        config.grad_sync_func = _per_chunk([chunk.start_grad_sync for chunk in chunks])
    config.finalize_model_grads_func = tied_embedding_finalize(finalize_model_grads, args.placements)
    optimizer = _optimizer(args, config, chunks)
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's train(): the loss scale, 1 without one
    scheduler = _scheduler(args, optimizer)
    validation = None
    if args.zero_bubble is not None and args.zero_bubble.post_validation:
        from ..optimizer import PostValidation

        validation = PostValidation(
            optimizer,
            chunks,
            parallel_state.get_pipeline_model_parallel_group(),
            mode=args.zero_bubble.post_validation_rollback,
            timeout_s=args.zero_bubble.p2p_timeout_s,
        )
        validation.attach_scheduler(scheduler)
    return Trainee(config, chunks, optimizer, scheduler, device, validation)


def _build_zero3(args: argparse.Namespace, config, chunks: list, device: torch.device) -> Trainee:
    """ZeRO-3: FSDP2-sharded chunks (``runtime.dp``); the runtime's backend runs the planned gathers and reductions."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig

    from ..megatron.gpt_model import tied_embedding_finalize
    from ..runtime.dp import wrap_zero3, zero3_optimizer

    chunks = wrap_zero3(config, chunks)
    config.finalize_model_grads_func = tied_embedding_finalize(finalize_model_grads, args.placements)
    optimizer_config = OptimizerConfig(**_same_names(args, OPTIMIZER_FIELDS), params_dtype=config.params_dtype)
    optimizer = zero3_optimizer(optimizer_config, chunks)
    config.grad_scale_func = optimizer.scale_loss
    return Trainee(config, chunks, optimizer, _scheduler(args, optimizer), device, None)


def _per_chunk(functions: list):
    return functions[0] if len(functions) == 1 else functions


def _optimizer(args: argparse.Namespace, config, chunks: list):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer_config = OptimizerConfig(**_same_names(args, OPTIMIZER_FIELDS), params_dtype=config.params_dtype)
    return get_megatron_optimizer(optimizer_config, chunks)


def _scheduler(args: argparse.Namespace, optimizer):
    """Megatron-LM's schedule, counted in samples as its training loop does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    samples = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
    )
