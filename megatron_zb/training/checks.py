"""The rules for every flag the launcher reads, checked once before any process starts.

Megatron-LM's ``validate_args`` asserts many of them (sizes positive, the global batch an exact
multiple of micro batch x data parallel, positions >= sequence, min-lr <= lr); torch and
megatron-core assert the rest deep inside each rank (dropout, Adam's betas, the loss scaler,
the learning-rate schedule's warm-up < decay). Here each one is a ValueError that names the flag,
the value and what would work. ``check_given`` runs on the values as typed, before defaults fill
them in (``--global-batch-size 0`` must not quietly become micro batch x data parallel) and
before anything divides by them. Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from ..checks import (
    TRAIN_FLAGS,
    ZERO_BUBBLE_SETTINGS,  # noqa: F401  (the schedule-only settings, importable from here)
    check_numbers,
    check_timeouts,
    first_set,
    flag,
    row,
)
from .moe_checks import MOE_ONLY

ROPE_ONLY = ("rotary_percent", "rotary_base", "use_rope_scaling", "rope_scaling_factor")


def check_given(args: argparse.Namespace) -> None:
    """Every number as given, in its flag's range (the flag table's); ValueError names the flag."""
    check_numbers(args, TRAIN_FLAGS)
    check_timeouts(args)


def check_zero3(args: argparse.Namespace) -> None:
    """``--use-torch-fsdp2`` (ZeRO-3) in the settings it is verified in; the rest refused by name."""
    if not getattr(args, "use_torch_fsdp2", False):
        return
    if args.zero_bubble is None:
        raise ValueError(
            "--use-torch-fsdp2 needs a megatron-zb schedule (--pipeline-schedule NAME, e.g. breadth-first): the "
            "schedule plans when each chunk's weights are gathered and its gradients reduced"
        )
    refused = dict(row("use_torch_fsdp2").excludes)
    name = first_set(args, refused)
    if name is not None:
        raise ValueError(f"--use-torch-fsdp2 with {flag(name)}: {refused[name]}; drop one of them")
    if args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise ValueError(
            "--use-torch-fsdp2 is verified without tensor or context parallelism so far; use "
            "--tensor-model-parallel-size 1 --context-parallel-size 1, or the distributed optimizer"
        )
    if args.zero_bubble.shared:
        raise ValueError(
            f"--use-torch-fsdp2 with --pipeline-schedule {args.zero_bubble.schedule}: a schedule that keeps two copies "
            "of each block sums their gradients in the DDP buffers; use the distributed optimizer instead"
        )
    if args.zero_bubble.post_validation:
        raise ValueError(
            "--use-torch-fsdp2 with --enable-optimizer-post-validation: a redone iteration prefix would gather "
            "chunks the undone step released; drop one of them"
        )
    for option in ("save", "load"):
        if getattr(args, option, None):
            raise ValueError(
                f"--{option} with --use-torch-fsdp2: checkpoints of sharded (FSDP2) chunks are not written yet; "
                "drop it, or train with the distributed optimizer"
            )


def default_ffn_hidden_size(args: argparse.Namespace) -> int:
    """Megatron-LM's default: 4 x hidden, or with --swiglu two thirds of it (two fc1 halves) in multiples of 64."""
    if not args.swiglu:
        return 4 * args.hidden_size
    size = int(4 * args.hidden_size * 2 / 3 / 64) * 64
    if size < 1:
        raise ValueError(
            f"--swiglu with --hidden-size {args.hidden_size}: Megatron-LM's default --ffn-hidden-size, "
            "int(8 x hidden / 3 / 64) x 64, is 0 below a hidden size of 24; give --ffn-hidden-size"
        )
    return size


def check_derived(args: argparse.Namespace) -> None:
    """The relations between flags, once defaults are filled in and the data-parallel size is known."""
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(
            f"--hidden-size {args.hidden_size} does not divide by --num-attention-heads {args.num_attention_heads} "
            f"(Megatron-LM's rule: without --kv-channels every head gets hidden/heads channels); use a multiple of "
            f"{args.num_attention_heads} or give --kv-channels"
        )
    if args.max_position_embeddings < args.seq_length:
        raise ValueError(
            f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length {args.seq_length}: "
            f"positions past it have no embedding; give at least {args.seq_length} (or leave it out)"
        )
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}; give a --min-lr of at most {args.lr}")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
            "(default: --train-iters), as megatron-core's learning-rate schedule requires; "
            f"use at most {args.lr_decay_iters - 1}"
        )
    if args.fp16 and args.min_loss_scale > args.initial_loss_scale:
        raise ValueError(
            f"--min-loss-scale {args.min_loss_scale:g} is above --initial-loss-scale {args.initial_loss_scale:g}; "
            "give a minimum at most the initial scale"
        )
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        nearest = per_step * max(1, round(args.global_batch_size / per_step))
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step} (the samples "
            f"left over would be dropped); use a multiple such as {nearest}"
        )


def check_architecture(args: argparse.Namespace) -> None:
    """Query groups and RoPE as megatron-core's local layer spec builds them (it asserts deep in each rank).

    Zero-centred norms and sequence parallelism need no check: megatron_zb.install() lets megatron-core's
    torch norms take both (``megatron/norms.py``).
    """
    _check_query_groups(args)
    _check_rotary(args)
    _check_mtp(args)


def _check_mtp(args: argparse.Namespace) -> None:
    """Multi-token prediction as Megatron-LM's validate_args takes it: its positions must be rope or none."""
    if getattr(args, "mtp_num_layers", None) and args.position_embedding_type == "learned_absolute":
        raise ValueError(
            "--mtp-num-layers with --position-embedding-type learned_absolute: Megatron-LM refuses multi-token "
            "prediction with learned absolute positions; use --position-embedding-type rope or none"
        )


def _check_query_groups(args: argparse.Namespace) -> None:
    """Each query group shares one key/value head; each tensor-parallel rank holds whole groups."""
    if not args.group_query_attention:
        return
    heads, groups, tp = args.num_attention_heads, args.num_query_groups, args.tensor_model_parallel_size
    if heads % groups:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ValueError(
            f"--num-attention-heads {heads} does not divide by --num-query-groups {groups} (every key/value head "
            f"serves the same number of query heads); use one of {divisors}"
        )
    if groups % tp:
        raise ValueError(
            f"--num-query-groups {groups} does not divide by --tensor-model-parallel-size {tp}: each tensor-parallel "
            f"rank holds whole key/value groups here (megatron-core's replication of fewer groups than ranks is not "
            f"verified); use a multiple of {tp} query groups or a tensor-parallel size that divides {groups}"
        )


def _check_rotary(args: argparse.Namespace) -> None:
    """RoPE rotates channel pairs: the rotated part of a head must be a positive even count."""
    if args.position_embedding_type != "rope":
        return
    channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    rotated = int(channels * args.rotary_percent)
    if rotated < 2 or rotated % 2:
        raise ValueError(
            f"--rotary-percent {args.rotary_percent:g} rotates int({channels} x {args.rotary_percent:g}) = {rotated} "
            f"of each head's {channels} channels; RoPE rotates pairs of channels: choose --rotary-percent (or "
            "--kv-channels) so that this count is even and at least 2"
        )


def refuse_cpu_flags(args: argparse.Namespace) -> None:
    """--cpu-threads sets the spawned processes' threads; under torchrun nothing reads it."""
    if not args.cpu and args.cpu_threads != 1:
        raise ValueError(
            f"--cpu-threads {args.cpu_threads} needs --cpu (it sets the threads of the processes --cpu spawns); "
            "under torchrun set OMP_NUM_THREADS instead"
        )


def check_megatron_lm_launch(launch: argparse.Namespace) -> None:
    """The flags ``megatron-zb train --megatron-lm`` reads itself (Megatron-LM's validate_args checks the rest)."""
    check_numbers(launch, (row("cpu_procs"), row("cpu_threads")))
    if not launch.cpu and (launch.cpu_procs is not None or launch.cpu_threads != 1):
        name = "--cpu-procs" if launch.cpu_procs is not None else "--cpu-threads"
        raise ValueError(f"{name} needs --cpu (under torchrun the launcher sets the processes and threads)")
    if launch.metrics_file:
        writable_file("--metrics-file", launch.metrics_file)


def check_placement(args: argparse.Namespace) -> None:
    """Several model chunks per rank need a pipeline, as in Megatron-LM (interleaving needs pp > 1)."""
    if args.pipeline_model_parallel_size > 1:
        return
    if args.zero_bubble is not None and args.placement.chunks > 1:
        chosen = f"--pipeline-schedule {args.zero_bubble.schedule}"
        if args.pipeline_schedule is None and args.zero_bubble_v_schedule:
            chosen = f"--zero-bubble-v-schedule ({args.zero_bubble.schedule})"
    elif (args.virtual_pipeline_model_parallel_size or 1) > 1:
        chosen = f"--virtual-pipeline-model-parallel-size {args.virtual_pipeline_model_parallel_size}"
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        chosen = f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
    else:
        return
    raise ValueError(
        f"{chosen} runs several model chunks on each pipeline rank and needs --pipeline-model-parallel-size 2 "
        "or more (as Megatron-LM's interleaved schedule); at pipeline size 1 leave the chunk and schedule flags out "
        "or use --pipeline-schedule 1f1b"
    )


def check_replan_window(args: argparse.Namespace) -> None:
    """A costs file that would never be written is refused: the timed window must end within the run."""
    settings = args.zero_bubble
    if settings is None or settings.timers is None or not settings.costs_file:
        return
    end = settings.timers[1]
    if end > args.train_iters:
        raise ValueError(
            f"--zero-bubble-save-costs {settings.costs_file}: the costs are measured up to iteration {end} "
            f"(--zero-bubble-pipeline-timers-end-iter) but --train-iters is {args.train_iters}, so nothing would be "
            "written; end the window within the run, e.g. --zero-bubble-pipeline-timers-start-iter 2 "
            f"--zero-bubble-pipeline-timers-end-iter {min(3, args.train_iters)}"
        )


def check_outputs(args: argparse.Namespace) -> None:
    """Every path the run writes is writable now, not after training reached it; file folders are created."""
    for name in ("metrics_file", "trace_file"):
        if getattr(args, name, None):
            writable_file(flag(name), getattr(args, name))
    if args.zero_bubble is not None and args.zero_bubble.costs_file:
        writable_file("--zero-bubble-save-costs", args.zero_bubble.costs_file)
    if args.save:
        writable_folder("--save", args.save)


def writable_file(option: str, path: str) -> None:
    """Create the file's folder and make sure a file can be written there; ValueError names the option."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file name inside it")
    existing = _nearest_existing(target.parent)
    if not existing.is_dir():
        raise ValueError(f"{option} {path} is under the file {existing}, not a folder; choose another path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot create its folder ({_reason(error)}); choose another path") from None
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ValueError(f"{option} {path}: the file is not writable; choose another path")
        return
    _probe(option, path, target.parent)


def writable_folder(option: str, path: str) -> None:
    """The folder exists and takes files, or can be created (nothing is created here)."""
    target = Path(path)
    existing = _nearest_existing(target)
    if not existing.is_dir():
        where = "is a file" if existing == target else f"is under the file {existing}"
        raise ValueError(f"{option} {path} {where}, not a folder; choose a folder path")
    _probe(option, path, existing)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(option: str, path: str, folder: Path) -> None:
    """Create and remove a temporary file in ``folder``: permissions, read-only mounts and /proc all show."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".megatron-zb-write-test-"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write in {folder} ({_reason(error)}); choose another path") from None


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def given(args: argparse.Namespace, parser: argparse.ArgumentParser) -> set[str]:
    """The flags set to something other than their default (call before defaults are derived)."""
    return {name for name, value in vars(args).items() if value != parser.get_default(name)}


def unused(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Flags given a value that changes nothing in this setting: warnings, not errors (Megatron-LM accepts them)."""
    notes = []
    if not args.fp16:
        dynamic = [name for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")]
        notes += [f"{flag(name)} applies to --fp16 only; it has no effect here" for name in dynamic if name in given]
        if "loss_scale" in given and not args.bf16:
            notes.append("--loss-scale applies to --fp16 or --bf16 only; it has no effect here")
    elif "loss_scale" in given:
        notes += [
            f"{flag(name)} sets the dynamic loss scale, which --loss-scale replaces; it has no effect here"
            for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
            if name in given
        ]
    if args.optimizer == "sgd":
        notes += [
            f"{flag(name)} applies to --optimizer adam only; it has no effect here"
            for name in ("adam_beta1", "adam_beta2", "adam_eps")
            if name in given
        ]
    if args.lr_decay_style == "constant":
        notes += [
            f"{flag(name)} has no effect with --lr-decay-style constant"
            for name in ("min_lr", "lr_decay_iters")
            if name in given
        ]
    notes += _unused_architecture(args, given)
    if args.num_experts is None:
        notes += [f"{flag(name)} applies to MoE models (--num-experts) only; it has no effect here"
                  for name in MOE_ONLY if name in given]  # fmt: skip
    from ..megatron.args import zero_bubble_notes

    notes += zero_bubble_notes(args)
    if "no_zero_bubble_replan" in given and args.zero_bubble is None:
        notes.append("--no-zero-bubble-replan applies to megatron-zb schedules only; it has no effect here")
    if args.exit_interval is not None and args.exit_interval > args.train_iters:
        notes.append(f"--exit-interval {args.exit_interval} is beyond --train-iters {args.train_iters}: no effect")
    return notes


def _unused_architecture(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Model flags that only matter next to another one (Megatron-LM accepts them alone and ignores them)."""
    notes = []
    if args.position_embedding_type != "rope":
        notes += [
            f"{flag(name)} applies to --position-embedding-type rope only; it has no effect here"
            for name in ROPE_ONLY
            if name in given
        ]
    elif "rope_scaling_factor" in given and not args.use_rope_scaling:
        notes.append("--rope-scaling-factor applies to --use-rope-scaling only; it has no effect here")
    if "num_query_groups" in given and not args.group_query_attention:
        notes.append(
            "--num-query-groups applies to --group-query-attention only (without it every head has its own "
            "key/value head); it has no effect here"
        )
    if args.add_qkv_bias and args.add_bias_linear:
        notes.append("--add-qkv-bias matters with --disable-bias-linear only (every linear has a bias); no effect here")
    return notes
