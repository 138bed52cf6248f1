"""A user's pretrain_gpt command line, scaled down to what this machine runs, every flag accounted for.

The line is read with Megatron-LM's own parser (``flags/megatron_lm_parser.py``), then each flag is either
kept as given, changed with a reason (sizes, parallel sizes, what a CPU cannot run), or dropped
with a reason (checkpoints it cannot load, logs it must not write into). What the schedule and
the training math depend on stays: normalization, activation, biases, RoPE, precision, optimizer,
loss, clipping, the distributed optimizer and its overlaps, the zero-bubble flags. The result is
two argvs for Megatron-LM's ``pretrain()``: the user's schedule, and megatron-core's own
(the zero-bubble flags removed), both drawing every weight from the seed and its name so that
placements compare.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Callable, Sequence

from ..checks import row
from ..flags.megatron_lm_parser import Given, flag_of
from ..flags.zero_bubble import KEYED_DROPOUT, SAME_INIT, ZERO_BUBBLE_FLAGS
from ..megatron_lm import preflight
from ..schedule.placement import Placement
from . import scale_experts
from .scaler import Change, Limits, Refused, ScaledLine, Scaler  # noqa: F401  (importable from here)

MAX_PROCESSES = 4  # gloo processes: two cores run four with the pool's overhead, not eight
HEAD_DIM = 8
SEQUENCE = 32
MOCK_VOCAB = 100
FP16_START_SCALE = 2**12
STALL_MINUTES = 5
# dest -> why a CPU run leaves the flag out (GPU-only features; the math around them runs as given)
GPU_ONLY = {
    "use_flash_attn": "flash attention is a CUDA kernel; megatron-core's local attention computes the same",
    "tp_comm_overlap": "Transformer Engine's userbuffer overlap needs GPUs; tensor-parallel results are the same",
    "fp8": "fp8 needs Transformer Engine on a Hopper or newer GPU; the scaled copy runs in the line's other "
    "precision (its fp8 GEMMs are not checked here)",
    "fp8_recipe": "fp8 is off on CPU",
    "fp8_margin": "fp8 is off on CPU",
    "fp8_interval": "fp8 is off on CPU",
    "fp8_amax_history_len": "fp8 is off on CPU",
    "fp8_amax_compute_algo": "fp8 is off on CPU",
    "fp8_wgrad": "fp8 is off on CPU",
    "fp8_param_gather": "fp8 is off on CPU",
    "fp8_output_proj": "fp8 is off on CPU",
    "first_last_layers_bf16": "fp8 is off on CPU",
    "num_layers_at_start_in_bf16": "fp8 is off on CPU",
    "num_layers_at_end_in_bf16": "fp8 is off on CPU",
    "fp4": "fp4 needs Transformer Engine on a Blackwell GPU",
    "fp4_recipe": "fp4 is off on CPU",
    "fp4_param_gather": "fp4 is off on CPU",
    "enable_cuda_graph": "CUDA graphs need a GPU",
    "cuda_graph_impl": "CUDA graphs need a GPU",
    "external_cuda_graph": "CUDA graphs need a GPU",
    "cuda_graph_scope": "CUDA graphs need a GPU",
    "use_te_activation_func": "Transformer Engine's activation needs a GPU; the local spec's computes the same",
    "use_transformer_engine_op_fuser": "Transformer Engine needs a GPU",
}
# megatron-zb's flags the scaled copy leaves out (why: each row's ``verify``)
OURS_NOT_USED = ("load", "exit_interval")
# dest -> why the scaled copy leaves the flag out (Megatron-LM's flags)
NOT_USED = {
    "pretrained_checkpoint": "a checkpoint of the full-size model does not fit the scaled copy",
    "use_checkpoint_args": "reads the model's sizes from the --load checkpoint, which the scaled copy does not load",
    "tensorboard_dir": "verify writes no logs into your folders (the losses it compares are its own)",
    "wandb_project": "verify sends nothing to Weights & Biases",
    "wandb_exp_name": "verify sends nothing to Weights & Biases",
    "wandb_save_dir": "verify sends nothing to Weights & Biases",
    "wandb_entity": "verify sends nothing to Weights & Biases",
    "profile": "profiling on CPU says nothing about GPU time",
    "profile_step_start": "profiling on CPU says nothing about GPU time",
    "profile_step_end": "profiling on CPU says nothing about GPU time",
    "use_pytorch_profiler": "profiling on CPU says nothing about GPU time",
    "profile_ranks": "profiling on CPU says nothing about GPU time",
    "exit_duration_in_mins": "the scaled copy runs all its iterations",
    "exit_signal_handler": "the scaled copy runs all its iterations",
    "decoder_first_pipeline_num_layers": "the scaled copy holds one layer per pipeline stage",
    "decoder_last_pipeline_num_layers": "the scaled copy holds one layer per pipeline stage",
    "pipeline_model_parallel_layout": "the scaled copy holds one layer per pipeline stage",
    "error_injection_rate": "injects faults on purpose (Megatron-LM's test of its re-run machinery: a run with an "
    "injected fault checkpoints and exits); verify compares two undisturbed runs",
    "error_injection_type": "no faults are injected (see --error-injection-rate)",
    "async_save": "the scaled copy saves once, at the end, and synchronously (an asynchronous save needs helper "
    "processes and, on Megatron-LM 0.19, nvidia-resiliency-ext; the schedule comparison does not depend on it)",
    "use_persistent_ckpt_worker": "goes with --async-save, which the scaled copy leaves out",
}
# dest -> why verify cannot check a line that sets it ({value}: the line's); megatron-zb's flags say it in their rows
REFUSED = {
    "multi_latent_attention": "--multi-latent-attention: megatron-core's local layer spec, the one a CPU runs, cannot "
    "build multi-latent attention (it needs Transformer Engine, on a GPU); verify the line without it, or on a GPU",
    "experimental_attention_variant": "--experimental-attention-variant {value}: megatron-core's experimental "
    "attention variants build with Transformer Engine only (a GPU); verify the line without it, or on a GPU",
    "use_torch_fsdp2": row("use_torch_fsdp2").verify,
    "yaml_cfg": "--yaml-cfg: verify scales a command line, not a YAML config; give the flags on the line",
    "moe_enable_deepep": "--moe-enable-deepep: DeepEP's token dispatcher is CUDA kernels across GPUs, which a CPU "
    "cannot run; verify the line with --moe-token-dispatcher-type alltoall, or on GPUs",
    "overlap_moe_expert_parallel_comm": "--overlap-moe-expert-parallel-comm: megatron-core's expert-parallel "
    "all-to-all overlap runs on CUDA streams and needs Transformer Engine, which a CPU cannot run (a megatron-zb "
    "schedule replaces that schedule); verify the line without it",
    "use_megatron_fsdp": "--use-megatron-fsdp: Megatron-FSDP keeps its parameter and gradient buffers on CUDA "
    "devices and gathers and reduce-scatters them on CUDA streams, which a CPU cannot run; verify the line with "
    "--use-distributed-optimizer in its place, or on GPUs",
}
# A line with context parallelism: why verify cannot check it here, and what runs on GPUs
CONTEXT_PARALLEL = (
    "--context-parallel-size {size}: megatron-core's local layer spec, the one a CPU runs, has no context-parallel "
    "attention (its DotProductAttention asserts a context-parallel size of 1; context-parallel attention is "
    "Transformer Engine's, on GPUs), so verify cannot run it here. On GPUs megatron-zb's schedules are not run with "
    "context parallelism yet either; megatron-core's own schedule runs it (drop the zero-bubble flags). Verify the "
    "line with tensor or data parallelism in its place"
)
# dest -> (the value verify cannot check, why)
REFUSED_VALUES = {
    "moe_token_dispatcher_type": (
        "flex",
        "--moe-token-dispatcher-type flex: the flex dispatcher is DeepEP's or HybridEP's, CUDA kernels across GPUs, "
        "which a CPU cannot run; verify the line with --moe-token-dispatcher-type alltoall, or on GPUs",
    ),
}
# Megatron-LM's pipeline split counts these as layers where the line asks (name, dest)
ACCOUNTED = (("embedding", "account_for_embedding_in_pipeline_split"), ("loss", "account_for_loss_in_pipeline_split"))
# Flags that only set sizes of the full model, replaced by the scaled ones (dest -> flag to name).
DATA_FILES = ("vocab_file", "merge_file", "tokenizer_model")


def on_cpu(parser: argparse.ArgumentParser, flags: Sequence[Given], args: argparse.Namespace) -> list[str]:
    """The line at full size with only what a CPU changes: GPU-only features out, the CPU settings in.

    Megatron-LM's ``validate_args`` on it says whether Megatron-LM takes the line itself, before any
    change of size could hide or cause a refusal.
    """
    scaler = Scaler(parser, flags, args)
    _cpu(scaler)
    line, _ = scaler.result()
    return [token for given in line for token in given.tokens]


def scale(
    parser: argparse.ArgumentParser,
    flags: Sequence[Given],
    args: argparse.Namespace,
    limits: Limits,
    schedule_of: Callable[[argparse.Namespace], object],
) -> ScaledLine:
    """The scaled copy of a parsed line; ``Refused`` names what cannot be checked.

    ``schedule_of`` returns megatron-zb's schedule settings for a namespace (None without one).
    """
    refuse(args)
    given_dp, limits = limits.data_parallel, scale_experts.expert_data_parallel(args, limits)
    scaler = Scaler(parser, flags, args)
    tp, pp, chunks_of = _parallel(scaler, limits)
    settings = schedule_of(_probe(args, pp, tp, limits))
    if settings is None:
        raise Refused(
            "no megatron-zb schedule on this line (add e.g. --enable-zero-bubble, --zero-bubble-v-schedule or "
            "--pipeline-schedule NAME): there is nothing to compare with megatron-core's own schedule"
        )
    blocks = chunks_of(settings)
    hidden, layers = _model(scaler, tp, pp, blocks)
    scale_experts.experts(scaler, tp, limits.data_parallel, limits.data_parallel != given_dp, hidden, layers)
    _batch(scaler, pp, limits)
    _iterations(scaler, limits)
    _data(scaler, limits)
    _checkpoints(scaler, limits, _rank_without_experts(args, settings.placement, layers))
    _cpu(scaler)
    for dest in OURS_NOT_USED:
        scaler.drop(dest, _ours(dest))
    for dest, why in NOT_USED.items():
        scaler.drop(dest, why)
    _zero_bubble(scaler, pp, limits)
    _moe_overlap(scaler, limits)
    line, kept = scaler.result()
    argv = [token for given in line for token in given.tokens]
    # megatron-core's run saves no checkpoint: the zb run's save checks the path (a torch_dist save
    # starts a spawned helper process, about 10 s on CPU)
    reference = [
        token
        for given in line
        if not _selects_schedule(given) and given.dest not in _SAVES | _OURS_IN_ZB_RUN
        for token in given.tokens
    ]
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return ScaledLine(
        argv=argv,
        reference_argv=reference,
        processes=tp * pp * limits.data_parallel,
        schedule=settings.schedule,
        precision=precision,
        changes=scaler.changes,
        kept=kept,
    )


def refuse(args: argparse.Namespace) -> None:
    """What verify cannot check at all (``Refused`` names it)."""
    mapped = preflight.mapped_flags(args)
    for dest, why in REFUSED.items():
        value = getattr(args, dest, None)
        if value and dest not in mapped:
            raise Refused(why.format(value=value))
    for dest, (value, why) in REFUSED_VALUES.items():
        if getattr(args, dest, None) == value:
            raise Refused(why)
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise Refused(CONTEXT_PARALLEL.format(size=args.context_parallel_size))


def _ours(name: str, **fill: object) -> str:
    """What verify's scaled copy does with one of megatron-zb's flags, and why: its row's ``verify``."""
    return row(name).verify.format(**fill)


def _set_ours(scaler: Scaler, name: str, values: Sequence[str] | None, **fill: object) -> None:
    scaler.set(row(name).option, values, _ours(name, **fill))


def _parallel(scaler: Scaler, limits: Limits):
    """Tensor and pipeline sizes this machine runs: tensor 2 at most, pipeline 2 to what fits in 4 processes."""
    args, dp = scaler.args, limits.data_parallel
    tp = min(args.tensor_model_parallel_size, 2)
    fewest = _fewest_stages(scaler)
    why_tp = None
    if fewest > 2 and MAX_PROCESSES // (tp * dp) < fewest and MAX_PROCESSES // dp >= fewest:
        tp, why_tp = 1, f"{INTERLEAVED_WITHOUT_OVERLAP}: tensor parallelism 1 leaves room for them"
    most_pp = max(2, MAX_PROCESSES // (tp * dp))
    pp = min(max(args.pipeline_model_parallel_size, fewest), most_pp)
    why = f"this machine runs {tp * pp * dp} gloo processes (at most {MAX_PROCESSES})"
    if tp != args.tensor_model_parallel_size:
        scaler.set("--tensor-model-parallel-size", [str(tp)], why_tp or why)
    if pp != args.pipeline_model_parallel_size:
        reason = why if args.pipeline_model_parallel_size > 1 else "a pipeline schedule needs two stages to compare"
        reason = INTERLEAVED_WITHOUT_OVERLAP if pp > args.pipeline_model_parallel_size > 1 else reason
        scaler.set("--pipeline-model-parallel-size", [str(pp)], reason)
    if getattr(args, "expert_model_parallel_size", 1) > 1 and not getattr(args, "num_experts", None):
        scaler.set("--expert-model-parallel-size", ["1"], "no experts in a dense model")
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if instances > 1 and limits.data_parallel % instances:
        scaler.set(
            "--num-distributed-optimizer-instances",
            ["1"],
            f"the scaled copy runs {limits.data_parallel} data-parallel copies, which {instances} optimizer instances "
            "cannot split",
        )

    def chunks_of(settings) -> int:
        return settings.placement.num_stages

    return tp, pp, chunks_of


INTERLEAVED_WITHOUT_OVERLAP = (
    "megatron-core's interleaved schedule without P2P overlap (which the CPU run turns off) needs more than two "
    "pipeline stages (Megatron-LM's validate_args)"
)


def _fewest_stages(scaler: Scaler) -> int:
    """Pipeline stages the scaled copy needs: three where megatron-core interleaves without P2P overlap, else two."""
    return 3 if _virtual_chunks(scaler.args) > 1 and scaler.knows("--no-overlap-p2p-communication") else 2


def _probe(args: argparse.Namespace, pp: int, tp: int, limits: Limits) -> argparse.Namespace:
    """The user's flags at the scaled sizes, for megatron-zb's schedule checks (blocks of one layer)."""
    probe = copy.copy(args)
    chunks = _virtual_chunks(args)
    vars(probe).update(
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        context_parallel_size=1,
        data_parallel_size=limits.data_parallel,
        micro_batch_size=1,
        global_batch_size=2 * pp * limits.data_parallel,
        num_layers=pp * 2 * chunks * 2,  # divides into any chunk count the schedules use here
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        zero_bubble_max_pending_backward=_scaled_limit(args, "zero_bubble_max_pending_backward", pp),
        zero_bubble_memory_limit=_scaled_limit(args, "zero_bubble_memory_limit", pp),
    )
    return probe


def _virtual_chunks(args: argparse.Namespace) -> int:
    from ..megatron.args import virtual_chunks

    return virtual_chunks(args) or 1


def _scaled_limit(args: argparse.Namespace, name: str, pp: int):
    value = getattr(args, name, None)
    if value is None:
        return None
    scaled = value * pp / args.pipeline_model_parallel_size
    return max(pp, round(scaled)) if isinstance(value, int) else max(float(pp) / 2, scaled)


def _model(scaler: Scaler, tp: int, pp: int, blocks: int) -> tuple[int, int]:
    """One layer per block; heads, groups and head size small, the GQA ratio and FFN ratio kept.

    Returns the scaled hidden size and layer count."""
    args = scaler.args
    accounted = [name for name, dest in ACCOUNTED if getattr(args, dest, False)]
    if accounted:
        layers = 2 * blocks - len(accounted)
        counted = " and the ".join(accounted)
        why = f"two per pipeline block ({blocks} blocks), the {counted} counted as one, as your line splits them"
        scaler.set("--num-layers", [str(layers)], why)
    else:
        layers = blocks
        scaler.set("--num-layers", [str(blocks)], f"one layer per pipeline block ({blocks} blocks)")
    if args.num_layers_per_virtual_pipeline_stage:
        _set_ours(scaler, "num_layers_per_virtual_pipeline_stage", ["1"])
    if args.group_query_attention:
        groups = max(tp, 2)
        heads = groups * max(1, args.num_attention_heads // args.num_query_groups)
        ratio = f"{args.num_attention_heads}:{args.num_query_groups}"
        scaler.set("--num-query-groups", [str(groups)], f"keeps the heads-to-groups ratio of {ratio}")
        scaler.set("--num-attention-heads", [str(heads)], f"keeps the heads-to-groups ratio of {ratio}")
    else:
        heads = 2 * tp
        scaler.set("--num-attention-heads", [str(heads)], f"two heads per tensor-parallel rank ({tp})")
    hidden = heads * HEAD_DIM
    if args.kv_channels is not None:
        _set_ours(scaler, "kv_channels", [str(HEAD_DIM)], value=HEAD_DIM)
    scaler.set("--hidden-size", [str(hidden)], f"{heads} heads of size {HEAD_DIM}")
    if args.ffn_hidden_size is not None:
        ratio = args.ffn_hidden_size / args.hidden_size
        ffn = max(2 * tp, round(ratio * hidden / (2 * tp)) * 2 * tp)
        scaler.set("--ffn-hidden-size", [str(ffn)], f"keeps the FFN-to-hidden ratio of {ratio:.3g}")
    elif args.swiglu and int(4 * hidden * 2 / 3 / 64) == 0:
        ffn = max(2 * tp, round(8 / 3 * hidden / (2 * tp)) * 2 * tp)
        scaler.set(
            "--ffn-hidden-size",
            [str(ffn)],
            "keeps SwiGLU's default ratio of 8/3 (Megatron-LM rounds that down to a multiple of 64: 0 at the scaled "
            f"hidden size {hidden}, an MLP with no units)",
        )
    _set_ours(scaler, "seq_length", [str(SEQUENCE)])
    if args.max_position_embeddings is not None:
        _set_ours(scaler, "max_position_embeddings", [str(SEQUENCE)])
    return hidden, layers


def _batch(scaler: Scaler, pp: int, limits: Limits) -> None:
    """Two microbatches per stage (2·pp per iteration); a batch-size ramp becomes pp then 2·pp microbatches."""
    args, dp = scaler.args, limits.data_parallel
    micro = min(args.micro_batch_size, 2)
    _set_ours(scaler, "micro_batch_size", [str(micro)])
    full = micro * dp * 2 * pp
    if args.rampup_batch_size is not None:
        start = micro * dp * pp
        samples = start * max(1, limits.iterations // 2)
        scaler.set(
            "--rampup-batch-size",
            [str(start), str(start), str(samples)],
            f"ramps from {pp} to {2 * pp} microbatches halfway, so the schedule is checked at both sizes",
        )
    if getattr(args, "step_batch_size_schedule", None) is not None:
        start = micro * dp * pp
        tokens = start * SEQUENCE * max(1, limits.iterations // 2)
        scaler.set(
            "--step-batch-size-schedule",
            [f"0:{start} {tokens}:{full}"],
            f"steps from {pp} to {2 * pp} microbatches halfway, so the schedule is checked at both sizes",
        )
        if not scaler.has("global_batch_size"):
            return  # the step schedule sets it (Megatron-LM refuses both, as on your line when it gives both)
    count, why = 2 * pp, f"{2 * pp} microbatches per iteration: the steady state"
    group = getattr(args, "microbatch_group_size_per_vp_stage", None)
    if group and _virtual_chunks(args) > 1:
        while count % group and count % group < pp:  # megatron-core's interleaved schedule refuses such a remainder
            count += 1
        if count != 2 * pp:
            why = (
                f"{count} microbatches per iteration: the fewest from {2 * pp} on that megatron-core's interleaved "
                f"schedule takes in groups of {group} (--microbatch-group-size-per-virtual-pipeline-stage) at "
                f"pipeline size {pp}"
            )
    scaler.set("--global-batch-size", [str(micro * dp * count)], why)


def _iterations(scaler: Scaler, limits: Limits) -> None:
    """Counted in iterations; the learning-rate schedule keeps its warm-up share."""
    args, iterations = scaler.args, limits.iterations
    _set_ours(scaler, "train_iters", [str(iterations)], value=iterations)
    scaler.drop("train_samples", f"counted in iterations: {_ours('train_iters', value=iterations)}")
    total = args.lr_decay_iters or args.lr_decay_samples or args.train_iters or args.train_samples
    warmup = args.lr_warmup_iters or args.lr_warmup_samples or 0
    if scaler.has("lr_decay_iters") or scaler.has("lr_decay_samples"):
        scaler.drop("lr_decay_samples", "counted in iterations")
        _set_ours(scaler, "lr_decay_iters", [str(iterations)])
    if warmup and total:
        share = warmup / total
        steps = min(iterations - 1, max(1, math.ceil(share * iterations))) if share > 0 else 0
        scaler.drop("lr_warmup_samples", "counted in iterations")
        scaler.set("--lr-warmup-iters", [str(steps)], f"keeps a warm-up (your share: {share:.3g} of the decay)")
    for dest in ("lr_wsd_decay_samples", "lr_wsd_decay_iters"):
        if scaler.has(dest):
            scaler.drop(dest, "the scaled run has no room for a separate WSD decay phase")
    if args.eval_iters:
        _set_ours(scaler, "eval_iters", ["1"])
        _set_ours(scaler, "eval_interval", [str(iterations)])
    _set_ours(scaler, "log_interval", ["1"])


def _data(scaler: Scaler, limits: Limits) -> None:
    """Real data where its files are here, else mock data of the same sequence length."""
    args = scaler.args
    missing = _missing_data_files(args)
    if args.mock_data or missing:
        why = f"not found here: {', '.join(missing[:2])}{' ...' if len(missing) > 2 else ''}; mock data instead"
        for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            scaler.drop(dest, why)
        mock = "the line's mock data" if args.mock_data else "the mock data that replaces the missing data files"
        for dest in DATA_FILES:
            path = getattr(args, dest, None)
            found = "found" if path and os.path.exists(path) else "not found here"
            scaler.drop(dest, f"{path}: {found}; {mock} runs with NullTokenizer")
        if not args.mock_data:
            scaler.set("--mock-data", None, why)
        _set_ours(scaler, "tokenizer_type", ["NullTokenizer"])
        _set_ours(scaler, "vocab_size", [str(MOCK_VOCAB)])
    if args.data_cache_path is not None or not args.mock_data:
        _set_ours(scaler, "data_cache_path", [str(limits.folder / "data-cache")])


def _missing_data_files(args: argparse.Namespace) -> list[str]:
    if args.mock_data:
        return []
    from ..training.data import split_blend

    prefixes = []
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, name, None):
            prefixes += split_blend(getattr(args, name))[0]
    files = [prefix + suffix for prefix in prefixes for suffix in (".bin", ".idx")]
    files += [getattr(args, name) for name in DATA_FILES if getattr(args, name, None)]
    missing = [path for path in files if not os.path.exists(path)]
    if not prefixes:
        missing.append("(no --data-path)")
    return missing


def _rank_without_experts(args: argparse.Namespace, placement: Placement, layers: int) -> int | None:
    """A rank of the scaled copy that holds MoE layers of the model but none of its own, when it matters for a save:
    Megatron's distributed optimizer on CPU (torch's Adam: no Transformer Engine or apex) asserts one step across
    its state when saving, and that rank's expert optimizer has none."""
    moe = scale_experts.moe_layers(args, layers)
    if not any(moe) or not args.use_distributed_optimizer or layers != placement.num_stages:
        return None  # one layer per block, as _model scales it (with the ends accounted: two, not looked at)
    for rank in range(placement.pp):
        if not any(moe[block] for block in range(layers) if placement.blocks[block][0] == rank):
            return rank
    return None


def _checkpoints(scaler: Scaler, limits: Limits, rank_without_experts: int | None = None) -> None:
    if scaler.args.save is not None and rank_without_experts is not None:
        why = (
            f"rank {rank_without_experts} of the scaled copy holds only dense layers, and on CPU (no Transformer "
            "Engine or apex) Megatron's distributed optimizer cannot save an expert optimizer without parameters "
            "(distrib_optimizer.state_dict asserts one step over an empty state): verify saves no checkpoint"
        )
        scaler.drop("save", why)
        scaler.drop("save_interval", why)
    elif scaler.args.save is not None:
        _set_ours(scaler, "save", [str(limits.folder / "checkpoints")])
        _set_ours(scaler, "save_interval", [str(limits.iterations)])
    else:
        scaler.drop("save_interval", "no --save on the line")


def _cpu(scaler: Scaler) -> None:
    """Transformer Engine, fp8/fp4, CUDA graphs and fused kernels off; the rest of the math as given."""
    for dest, why in GPU_ONLY.items():
        scaler.drop(dest, why)
    for dest, why in preflight.CPU_DROPPED.items():
        scaler.drop(dest, why)
    _recompute_without_grouped_gemm(scaler)
    for setting in preflight.cpu_additions([], scaler.parser):
        scaler.set(setting.flag, None if setting.value is None else [setting.value], setting.why)
    backend = scaler.value("attention_backend")
    if backend is not None and getattr(backend, "name", backend) != "auto":
        scaler.set("--attention-backend", ["auto"], "megatron-core's local layer spec runs its own attention on CPU")
    if scaler.value("cross_entropy_fusion_impl") == "te":
        scaler.set("--cross-entropy-fusion-impl", ["native"], "Transformer Engine's fused cross entropy needs a GPU")
    if scaler.args.fp16 and scaler.args.loss_scale is None and scaler.args.initial_loss_scale > FP16_START_SCALE:
        _set_ours(scaler, "initial_loss_scale", [str(FP16_START_SCALE)])
    if scaler.args.distributed_timeout_minutes > STALL_MINUTES:
        _set_ours(scaler, "distributed_timeout_minutes", [str(STALL_MINUTES)], value=STALL_MINUTES)
    if _virtual_chunks(scaler.args) > 1 and scaler.knows("--no-overlap-p2p-communication"):
        scaler.set(
            "--no-overlap-p2p-communication",
            None,
            "megatron-core's interleaved schedule frees a sent output while a gloo send is in flight (the reference "
            "run would diverge on CPU)",
        )


def _recompute_without_grouped_gemm(scaler: Scaler) -> None:
    """megatron-core recomputes the experts' activation (``moe_act``) with grouped GEMM only, which a CPU leaves out."""
    modules = scaler.value("recompute_modules") or []
    if not scaler.value("moe_grouped_gemm") or "moe_act" not in modules:
        return
    why = "megatron-core recomputes the experts' activation with grouped GEMM only, which is off on CPU"
    rest = [module for module in modules if module != "moe_act"]
    if rest:
        scaler.set("--recompute-modules", rest, f"moe_act left out: {why}")
    else:
        scaler.drop("recompute_modules", why)


def _zero_bubble(scaler: Scaler, pp: int, limits: Limits) -> None:
    args = scaler.args
    for name in ("zero_bubble_max_pending_backward", "zero_bubble_memory_limit"):
        value = _scaled_limit(args, name, pp)
        if value is not None:
            _set_ours(scaler, name, [str(value)], ratio=getattr(args, name) / args.pipeline_model_parallel_size)
    if getattr(args, "zero_bubble_save_costs", None):
        _set_ours(scaler, "zero_bubble_save_costs", [str(limits.folder / "costs.json")])
    _set_ours(scaler, "zero_bubble_placement_independent_init", None)
    if args.hidden_dropout or args.attention_dropout:
        _set_ours(scaler, "zero_bubble_order_independent_dropout", None)


_SAVES = frozenset({"save", "save_interval"})
# Megatron-LM's flags that a megatron-zb schedule gives its own meaning (megatron_mapping): megatron-core's run
# leaves them out
_OURS_IN_ZB_RUN = frozenset({"overlap_moe_expert_parallel_comm"})
TIMED = ("1", "2")  # iterations timed to re-plan where the line's pairs need it: the rest run the re-planned schedule


def _moe_overlap(scaler: Scaler, limits: Limits) -> None:
    """--overlap-moe-expert-parallel-comm under a megatron-zb schedule: our overlapped F&B pairs
    (``megatron_mapping.moe_overlap_as_pairs``), placed by a re-plan inside the scaled run; megatron-core's run
    leaves the flag out (its CUDA-stream overlap moves no number)."""
    if not scaler.has("overlap_moe_expert_parallel_comm"):
        return
    flag = "--overlap-moe-expert-parallel-comm"
    if limits.iterations <= int(TIMED[1]):
        raise Refused(
            f"{flag} with a megatron-zb schedule runs overlapped F&B pairs, placed when the schedule is re-planned "
            f"after timed iterations {TIMED[0]}-{TIMED[1]}: give --verify-iters {int(TIMED[1]) + 1} or more"
        )
    why = f"{flag}: the re-plan that places the overlapped F&B pairs, inside the scaled run"
    scaler.set("--zero-bubble-pipeline-timers-start-iter", [TIMED[0]], why)
    scaler.set("--zero-bubble-pipeline-timers-end-iter", [TIMED[1]], why)
    scaler.note(
        "overlap_moe_expert_parallel_comm",
        "with a megatron-zb schedule it means --zero-bubble-overlap-f-b (overlapped F&B pairs); megatron-core's "
        "run leaves it out: its CUDA-stream overlap needs a GPU and changes no number",
    )


def _selects_schedule(given: Given) -> bool:
    """Flags of megatron-zb's group other than the shared initialisation and dropout: dropped for megatron-core's
    run."""
    return given.dest in _ZERO_BUBBLE_DESTS and flag_of(given.action) not in (SAME_INIT, KEYED_DROPOUT)


_ZERO_BUBBLE_DESTS = frozenset(flag.name for flag in ZERO_BUBBLE_FLAGS)
