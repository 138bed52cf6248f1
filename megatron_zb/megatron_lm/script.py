"""What Megatron-LM's ``pretrain_gpt.py`` hands ``pretrain()``, for installs with no Megatron-LM checkout.

megatron-core 0.17 and later wheels ship ``megatron.training`` (``pretrain()``, its argument parser,
checkpoints, logging) but not the scripts at a checkout's root. This module is the GPT part of such a
script, written on megatron-core's public pieces, so that ``megatron-zb train --megatron-lm`` and
``megatron-zb verify`` run the installed ``pretrain()`` without a checkout:

- datasets: megatron-core's mock or indexed GPT datasets, built on every tensor-parallel rank of the
  ranks whose chunks take data (each rank reads its own copy, so nothing is broadcast and a V
  placement's rank 0 gets tokens and labels for both of its chunks);
- the forward step and the loss: the summed token losses and the token count, as pretrain_gpt's;
- the embedding ranks; before 0.18, whose ``pretrain()`` takes a model provider, the GPTModel itself
  (0.18 and later build it from ``gpt_config_from_args``).

It covers dense GPT pretraining. What pretrain_gpt.py does beyond that (SFT, FIM data, multi-token
prediction, context parallelism, distillation, ModelOpt, YAML configs, legacy models) is refused by
``refused_features``, before any process starts; a checkout (``--megatron-lm PATH``) runs them.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

# (args field, flag) this module does not implement; each is refused when set.
UNSUPPORTED = (
    ("sft", "--sft"),
    ("fim_data", "--fim-data"),
    ("mtp_num_layers", "--mtp-num-layers"),
    ("logits_load_dir", "--logits-load-dir"),
    ("yaml_cfg", "--yaml-cfg"),
    ("use_legacy_models", "--use-legacy-models"),
    ("spec", "--spec"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
    ("hybrid_context_parallel", "--hybrid-context-parallel"),
)


def refused_features(args: argparse.Namespace) -> list[str]:
    """The flags of ``args`` this module cannot run, each with what would."""
    found = [flag for name, flag in UNSUPPORTED if getattr(args, name, None)]
    if getattr(args, "context_parallel_size", 1) > 1:
        found.append("--context-parallel-size > 1")
    return found


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """megatron-core's GPT datasets (mock or indexed) on the ranks whose chunk ``vp_stage`` takes data."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {kind.__name__} train, validation and test splits (megatron-zb's GPT providers)")
    return BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, partial(_takes_data, vp_stage), dataset_config(args)
    ).build()


train_valid_test_datasets_provider.is_distributed = True  # built where _takes_data says, not on tp rank 0 only


def _takes_data(vp_stage=None) -> bool:
    """The chunks with the first or the last layer block read batches (every tensor-parallel rank of them)."""
    from megatron.training import utils

    return utils.is_first_or_last_pipeline_stage(vp_stage)


def dataset_config(args: argparse.Namespace):
    """megatron-core's GPTDatasetConfig from Megatron-LM's arguments, with the fields this version has."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    wanted = {
        "random_seed": args.seed,
        "sequence_length": args.seq_length,
        "blend": blend,
        "blend_per_split": blend_per_split,
        "split": args.split,
        "path_to_cache": args.data_cache_path,
        "mmap_bin_files": args.mmap_bin_files,
        "tokenizer": get_tokenizer(),
        "reset_position_ids": args.reset_position_ids,
        "reset_attention_mask": args.reset_attention_mask,
        "eod_mask_loss": args.eod_mask_loss,
        "create_attention_mask": args.create_attention_mask_in_dataloader,
        "data_parallel_size": args.data_parallel_size,
        "context_parallel_size": args.context_parallel_size,
        "sequence_parallel_size": args.tensor_model_parallel_size * args.sequence_parallel,
    }
    for name in (
        "multiple_validation_sets",
        "full_validation",
        "num_dataset_builder_threads",
        "object_storage_cache_path",
        "mid_level_dataset_surplus",
        "allow_ambiguous_pad_tokens",
    ):
        if hasattr(args, name):
            wanted[name] = getattr(args, name)
    names = {field.name for field in dataclasses.fields(GPTDatasetConfig) if field.init}
    return GPTDatasetConfig(**{name: value for name, value in wanted.items() if name in names})


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One microbatch through ``model``: its token losses, and the loss function that reduces them."""
    from megatron.core.utils import get_attr_wrapped_model

    if return_schedule_plan:
        raise NotImplementedError("megatron-zb's GPT providers do not build MoE schedule plans")
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, vp_stage, device)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])


BATCH_FIELDS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage, device) -> dict:
    """This chunk's batch on ``device``; chunks without the first or last block take none (all None)."""
    if not _takes_data(vp_stage):
        return dict.fromkeys(BATCH_FIELDS)
    batch = next(data_iterator)
    return {name: _to(batch.get(name), device) for name in BATCH_FIELDS}


def _to(tensor, device):
    return None if tensor is None else tensor.to(device, non_blocking=True)


def loss_func(loss_mask, output_tensor):
    """(summed loss, token count, report): megatron-core's schedules divide by the tokens unless per-token loss."""
    import torch
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        _reject_nan(loss)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def _reject_nan(loss) -> None:
    """Megatron-LM's rerun state machine checks the local loss (fatal on NaN or inf), as pretrain_gpt does."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        machine.validate_result(
            result=loss,
            rejection_func=reject,
            message=f"found {what} in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )


def get_embedding_ranks(pp_ranks: list[int], *args) -> list[int]:
    """The first pipeline rank, and the last one when it holds a tied copy of the word embedding."""
    from megatron.training import get_args

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """A megatron-core GPTModel from Megatron-LM's arguments (``pretrain()`` before 0.18 takes a provider)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    extra = {"vp_stage": vp_stage} if vp_stage is not None else {}
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        **extra,
    )


def layer_spec(args: argparse.Namespace, config):
    """Transformer Engine's layer spec with ``--transformer-impl transformer_engine``, else megatron-core's local."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm, fp8=args.fp8)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
