"""Zero-bubble flags for Megatron-LM's argument parser, and the checks that refuse bad combinations.

``add_args`` adds the flag table's zero-bubble rows (``flags/zero_bubble.py``: the reference
implementation's names and meanings, so launch scripts written for it run unchanged, plus ours).
``schedule_settings(args)`` turns a parsed namespace (Megatron-LM's names) into the schedule to run,
or refuses it before any process group exists.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..checks import (
    breadth_first_group,
    check_numbers,
    check_zero_bubble_numbers,
    refuse_zero_bubble_settings,
    row,
    wait_timeout_s,
)
from ..flags.table import add_to
from ..flags.zero_bubble import V_MEMORY_SETUPS, ZERO_BUBBLE_FLAGS
from ..schedule import Schedule, ScheduleError, ScheduleSpec, names
from ..schedule.placement import Placement
from ..schedule.registry import get, with_option
from ..schedule.schedule_file import FILE_PREFIX, build_schedule, load_schedule, refuse_other_setting
from .layer_split import layers_per_block
from .megatron_mapping import ENDS, MEGATRON_LAYOUT_FLAGS, foreign_placement

# Schedule-core option names, as a Megatron user knows them.
_FLAG_NAMES = {"--chunks": "--virtual-pipeline-model-parallel-size", "--memory-limit": "--zero-bubble-memory-limit"}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the zero-bubble group (the table's rows, ``flags/zero_bubble.py``); usable as Megatron-LM's
    ``extra_args_provider``."""
    return add_to(parser, ZERO_BUBBLE_FLAGS, types={"schedule": _schedule_choice}, fill=help_fill())


def help_fill() -> dict[str, str]:
    """What the zero-bubble flags' help names from the schedule registry."""
    return {
        "schedules": ", ".join(names()),
        "file_prefix": FILE_PREFIX,
        "memory_limit_schedules": ", ".join(with_option("memory_limit")),
    }


ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def extra_args_provider(other: ArgsProvider | None = None) -> ArgsProvider:
    """``add_args`` after ``other``: pretrain() takes one ``extra_args_provider``, and pretrain_gpt.py passes its own.

    Megatron-LM parses with ``parser = extra_args_provider(parser)``, so each provider's returned
    parser is what the next one extends.
    """
    if other is None or other is add_args:
        return add_args

    def both(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        extended = other(parser)
        return add_args(parser if extended is None else extended)

    return both


def _schedule_choice(text: str) -> str:
    if text in names() or (text.startswith(FILE_PREFIX) and len(text) > len(FILE_PREFIX)):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(names())}, or {FILE_PREFIX}PATH)"
    )


@dataclass(frozen=True)
class ZeroBubbleSettings:
    """What the runtime needs from the flags: one schedule, checked against the model and batch."""

    schedule: str
    memory_limit: float | None
    chunks: int | None
    microbatches: int
    placements: tuple[Placement, ...]  # every pipe's (BitPipe: two), as Schedule.placements
    pad_layers: bool
    timers: tuple[int, int] | None  # the re-planning window, None when re-planning is off
    costs_file: str | None
    post_validation: bool
    post_validation_rollback: str
    p2p_timeout_s: float
    breadth_first_microbatches: int | None = None  # breadth-first families: microbatches per group
    shared: tuple = ()  # blocks kept twice (Schedule.shared)
    layers: int | None = None  # the model's, for ``auto`` (None with --allow-padding-num-layers)
    overlap_f_b: bool = False  # re-plans place overlapped F&B pairs (--zero-bubble-overlap-f-b)

    @property
    def placement(self) -> Placement:
        """The first pipe's placement (the only one but for BitPipe), as Schedule.placement."""
        return self.placements[0]


def enabled(args: argparse.Namespace) -> bool:
    return bool(
        getattr(args, "enable_zero_bubble", False)
        or getattr(args, "zero_bubble_v_schedule", False)
        or getattr(args, "enable_bitpipe_schedule", False)
        or getattr(args, "pipeline_schedule", None)
    )


def schedule_settings(args: argparse.Namespace) -> ZeroBubbleSettings | None:
    """The schedule the flags ask for, or None when zero bubble is off; ValueError when it cannot run.

    Reads Megatron-LM's names: pipeline/tensor/context sizes, ``num_layers``, the batch sizes
    and ``data_parallel_size`` (derive it before calling).
    """
    check_zero_bubble_numbers(args)
    if not enabled(args):
        _refuse_zero_bubble_only_flags(args)
        return None
    name, memory_limit = _schedule_name(args)
    pp = args.pipeline_model_parallel_size
    chunks = virtual_chunks(args)
    microbatches = _microbatches(args)
    _refuse_unsupported_models(args)
    post_validation = _post_validation(args)
    group = _breadth_first_group(args, microbatches)
    if group is not None and (name.startswith(FILE_PREFIX) or "breadth_first_microbatches" not in get(name).options):
        raise ValueError(
            f"--breadth-first-micro-batches/--depth-first-micro-batches have no effect on --pipeline-schedule {name}; "
            f"they group the microbatches of {', '.join(_breadth_first_schedules())}"
        )
    pad = bool(getattr(args, "allow_padding_num_layers", False))
    layout = _megatron_layout_flags(args)
    # ``auto`` weighs only placements whose blocks split the layers; Megatron-LM's layout flags split them itself
    layers = None if pad or layout else args.num_layers
    try:
        spec = ScheduleSpec(
            pp,
            microbatches,
            chunks,
            memory_limit=memory_limit,
            post_validation=post_validation,
            breadth_first_microbatches=group,
            layers=layers,
        )
        if name.startswith(FILE_PREFIX):
            _refuse_other_setting(args, name, microbatches, chunks)
        schedule = build_schedule(name, spec)
    except ScheduleError as error:
        raise ValueError(f"--pipeline-schedule {name}: {_megatron_flags(str(error))}") from None
    fixed = getattr(args, "zero_bubble_block_layers", None) is not None  # by megatron_mapping.prepare_args
    if not fixed and (not layout or foreign_placement(schedule.placement) is not None):  # else validate_args checks
        check_layers(args.num_layers, schedule, pad, *(getattr(args, field, None) for field in ENDS))
    if getattr(args, "mtp_num_layers", None) and len(schedule.placements) > 1:
        raise ValueError(MTP_TWO_PIPES.format(name=name, pipes=len(schedule.placements)))
    if schedule.shared and post_validation:
        raise ValueError(
            f"--pipeline-schedule {name} keeps two copies of each block, whose gradients are summed inside the "
            "iteration: --enable-optimizer-post-validation does not support it yet; drop one of them"
        )
    return ZeroBubbleSettings(
        schedule=name,
        memory_limit=memory_limit,
        chunks=chunks,  # as asked: an automatic choice re-planned at run time must pick the same family
        microbatches=microbatches,
        placements=schedule.placements,
        pad_layers=pad,
        timers=_replan_window(args),
        costs_file=getattr(args, "zero_bubble_save_costs", None),
        post_validation=post_validation,
        post_validation_rollback=getattr(args, "optimizer_post_validation_rollback", "exact"),
        p2p_timeout_s=wait_timeout_s(args),
        breadth_first_microbatches=group,
        shared=schedule.shared,
        layers=layers,
        overlap_f_b=_overlap_f_b(args, post_validation),
    )


def _refuse_other_setting(args: argparse.Namespace, name: str, microbatches: int, chunks: int | None) -> None:
    """A schedule file must be planned for this run; the refusal names the flags that set it."""
    schedule = load_schedule(name.removeprefix(FILE_PREFIX), name).schedule
    dp = getattr(args, "data_parallel_size", 1) or 1
    global_batch = getattr(args, "global_batch_size", None) or args.micro_batch_size * dp
    batch = (
        f"--global-batch-size {global_batch} / (--micro-batch-size {args.micro_batch_size} x data-parallel size {dp})"
    )
    asked = {
        "pp": ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        "microbatches": (batch, microbatches),
        "chunks": ("--virtual-pipeline-model-parallel-size", chunks),
    }
    refuse_other_setting("the file", schedule, asked)


def _breadth_first_schedules() -> list[str]:
    return [name for name in names() if "breadth_first_microbatches" in get(name).options]


def _breadth_first_group(args: argparse.Namespace, microbatches: int) -> int | None:
    """Microbatches per breadth-first group from either flag; checked against the microbatches per iteration."""
    breadth = getattr(args, "breadth_first_micro_batches", None)
    depth = getattr(args, "depth_first_micro_batches", None)
    per_iteration = " per iteration (global batch / (micro batch x data-parallel size))"
    return breadth_first_group(breadth, depth, microbatches, per_iteration)


def _post_validation(args: argparse.Namespace) -> bool:
    if not getattr(args, "enable_optimizer_post_validation", False):
        if getattr(args, "optimizer_post_validation_rollback", "exact") != "exact":
            raise ValueError(
                "--optimizer-post-validation-rollback chooses how post-validation undoes a step; it needs "
                "--enable-optimizer-post-validation"
            )
        return False
    if getattr(args, "log_num_zeros_in_grad", False):
        raise ValueError(
            "--enable-optimizer-post-validation does not support --log-num-zeros-in-grad: counting zeros needs a "
            "global all-reduce every step; drop one of them"
        )
    if getattr(args, "overlap_param_gather", False):
        raise ValueError(
            "--enable-optimizer-post-validation does not support --overlap-param-gather: the all-gather of updated "
            "parameters would run inside forwards that an undone step has to redo; drop one of them"
        )
    optimizer = getattr(args, "optimizer", "adam")
    if getattr(args, "optimizer_post_validation_rollback", "exact") == "in-place" and optimizer != "adam":
        raise ValueError(
            f"--optimizer-post-validation-rollback in-place undoes a step by running Adam's update backwards; "
            f"--optimizer {optimizer} has no such inverse: use --optimizer-post-validation-rollback exact"
        )
    return True


def _overlap_f_b(args: argparse.Namespace, post_validation: bool) -> bool:
    """--zero-bubble-overlap-f-b, where it can hide something and the pairs can run."""
    if not getattr(args, "zero_bubble_overlap_f_b", False):
        return False
    flag = "--zero-bubble-overlap-f-b"
    if not getattr(args, "num_experts", None) or (getattr(args, "expert_model_parallel_size", 1) or 1) < 2:
        raise ValueError(
            f"{flag} hides the expert-parallel all-to-all of MoE layers behind another microbatch's compute: it "
            "needs --num-experts and --expert-model-parallel-size of 2 or more"
        )
    modules = getattr(args, "recompute_modules", None) or []
    if getattr(args, "recompute_granularity", None) == "full" or "moe" in modules:
        raise ValueError(
            f"{flag} with recomputation of whole layers or MoE layers: a backward that recomputes its forward would "
            "run the MoE dispatcher beside the other microbatch's forward; drop --recompute-granularity full "
            "(or 'moe' from --recompute-modules), as megatron-core's own all-to-all overlap requires"
        )
    if post_validation:
        raise ValueError(
            f"{flag} with --enable-optimizer-post-validation: an iteration prefix redone after an undone step may "
            "end inside a pair; use one of them"
        )
    if _replan_window(args) is None:
        raise ValueError(
            f"{flag} places the pairs when the schedule is re-planned with the measured all-to-all time, which "
            "--no-zero-bubble-replan turns off; drop one of them"
        )
    return True


def _replan_window(args: argparse.Namespace) -> tuple[int, int] | None:
    start = getattr(args, "zero_bubble_pipeline_timers_start_iter", 100)
    end = getattr(args, "zero_bubble_pipeline_timers_end_iter", 110)
    if getattr(args, "no_zero_bubble_replan", False):
        if getattr(args, "zero_bubble_save_costs", None):
            raise ValueError(
                "--zero-bubble-save-costs saves the costs measured for re-planning; drop it or --no-zero-bubble-replan"
            )
        if (start, end) != (100, 110):
            raise ValueError(
                "--zero-bubble-pipeline-timers-start-iter/-end-iter choose the iterations timed for re-planning, "
                "which --no-zero-bubble-replan turns off; drop one of them"
            )
        return None
    if start < 1:
        raise ValueError(
            f"--zero-bubble-pipeline-timers-start-iter must be at least 1 (the first training iteration), got "
            f"{start}; use --no-zero-bubble-replan to turn re-planning off"
        )
    if end < start:
        raise ValueError(
            f"--zero-bubble-pipeline-timers-end-iter ({end}) is before --zero-bubble-pipeline-timers-start-iter "
            f"({start}); give an end at or after the start"
        )
    return start, end


def _schedule_name(args: argparse.Namespace) -> tuple[str, float | None]:
    """(registered name, memory limit) from the reference flags or --pipeline-schedule."""
    pp = args.pipeline_model_parallel_size
    limit = getattr(args, "zero_bubble_memory_limit", None)
    pending = getattr(args, "zero_bubble_max_pending_backward", None)
    if limit is not None and pending is not None:
        raise ValueError(
            "--zero-bubble-memory-limit and --zero-bubble-max-pending-backward both set a memory limit; give one"
        )
    if getattr(args, "enable_bitpipe_schedule", False):
        if getattr(args, "zero_bubble_v_schedule", False) or getattr(args, "enable_zero_bubble", False):
            raise ValueError(
                "--enable-bitpipe-schedule selects BitPipe; drop --enable-zero-bubble/--zero-bubble-v-schedule, or "
                "use --pipeline-schedule bitpipe-zb for BitPipe with the backward split"
            )
        implied = "bitpipe"
    elif getattr(args, "zero_bubble_v_schedule", False):
        implied = V_MEMORY_SETUPS[args.zero_bubble_v_schedule_mem_setup]  # pending has no effect: zero_bubble_notes
    elif getattr(args, "enable_zero_bubble", False):
        pending = pending if pending is not None else pp
        implied = {pp: "zb-1p", 2 * pp: "zb-2p"}.get(pending, "zb-auto")
        limit = float(pending) if implied == "zb-auto" else limit
    else:
        implied = None
    chosen = getattr(args, "pipeline_schedule", None)
    if chosen is not None and implied is not None and chosen != implied:
        raise ValueError(
            f"--pipeline-schedule {chosen} conflicts with the reference flags, which select {implied}; "
            f"drop --enable-zero-bubble/--zero-bubble-v-schedule/--enable-bitpipe-schedule or choose "
            f"--pipeline-schedule {implied}"
        )
    name = chosen or implied
    planned = with_option("memory_limit")  # the schedules that plan under a limit (the registry's options)
    if limit is not None and name not in planned:
        raise ValueError(
            f"--zero-bubble-memory-limit applies to the automatic schedules ({', '.join(planned)}), "
            f"not to {name}; drop it or choose one of those"
        )
    return name, limit


def zero_bubble_notes(args: argparse.Namespace) -> list[str]:
    """Flags the reference implementation's scripts give that change nothing here: one line each, to print."""
    notes = []
    if getattr(args, "enable_zb_runtime", False):
        notes.append("--enable-zb-runtime has no effect: megatron-zb's runtime runs every zero-bubble schedule")
    if getattr(args, "zero_bubble_v_schedule", False) and getattr(args, "zero_bubble_max_pending_backward", None):
        notes.append(
            "--zero-bubble-max-pending-backward has no effect on V schedules: their memory is set by "
            "--zero-bubble-v-schedule-mem-setup {zb,half,min}, or --pipeline-schedule v-auto with "
            "--zero-bubble-memory-limit"
        )
    return notes


def virtual_chunks(args: argparse.Namespace) -> int | None:
    """Chunks per rank the virtual-pipeline flags ask for (None: not given); ValueError when they do not split."""
    # Megatron-LM's newer name for it; its validate_args copies it into virtual_pipeline_model_parallel_size
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or getattr(
        args, "num_virtual_stages_per_pipeline_rank", None
    )
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_stage is not None:
        blocks, rest = divmod(args.num_layers, per_stage * args.pipeline_model_parallel_size)
        if rest or (vp is not None and vp != blocks):
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage} does not split --num-layers "
                f"{args.num_layers} into pipeline size {args.pipeline_model_parallel_size} x chunks; "
                "give --virtual-pipeline-model-parallel-size instead"
            )
        vp = blocks
    return vp


def _microbatches(args: argparse.Namespace) -> int:
    dp = getattr(args, "data_parallel_size", 1) or 1
    check_numbers(args, (row("micro_batch_size"), row("global_batch_size")))
    per_step = args.micro_batch_size * dp
    global_batch = getattr(args, "global_batch_size", None)
    global_batch = per_step if global_batch is None else global_batch
    if global_batch % per_step:
        nearest = per_step * max(1, global_batch // per_step)
        raise ValueError(
            f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {args.micro_batch_size} "
            f"x data-parallel size {dp} = {per_step}; use a multiple such as {nearest}"
        )
    return global_batch // per_step


CONTEXT_PARALLEL_REFUSED = (
    "megatron-zb schedules do not support --context-parallel-size > 1 yet ({size} given), on GPUs either: their "
    "runtime scales the loss by the context-parallel size as megatron-core's forward_step does, but "
    "no context-parallel run through it has been checked (that needs Transformer Engine's attention, on GPUs; "
    "megatron-core's local layer spec, the one a CPU runs, cannot build it). Run the line with megatron-core's own "
    "schedule (drop the zero-bubble flags), or with tensor or data parallelism in place of context parallelism"
)


MTP_TWO_PIPES = (
    "--pipeline-schedule {name} runs {pipes} pipes, each with its own copy of the loss block: multi-token "
    "prediction (--mtp-num-layers) keeps its embedding copy and layers there, and two copies of them are not "
    "supported yet; one-pipe schedules (zb-1p, zb-2p, interleaved zb, zb-v, v-auto) run it"
)


def _refuse_unsupported_models(args: argparse.Namespace) -> None:
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        raise ValueError(CONTEXT_PARALLEL_REFUSED.format(size=cp))
    if is_encoder_and_decoder(args):
        raise ValueError(
            "megatron-zb schedules run decoder-only models (GPT); encoder-decoder models (--encoder-num-layers "
            "with --decoder-num-layers, as T5) are not supported: drop the zero-bubble flags to run megatron-core's "
            "own schedule"
        )


def is_encoder_and_decoder(args: argparse.Namespace) -> bool:
    """An encoder-decoder model, told apart as Megatron-LM does: by ``--decoder-num-layers`` or the model type.

    Megatron-LM's validate_args copies ``num_layers`` into ``encoder_num_layers`` for every model
    (GPT included), so that field says nothing; T5 gives ``--encoder-num-layers`` and
    ``--decoder-num-layers`` and pretrain() gets ``ModelType.encoder_and_decoder``.
    """
    if getattr(args, "decoder_num_layers", None) is not None:
        return True
    model_type = getattr(args, "model_type", None)
    if getattr(model_type, "name", None) == "encoder_and_decoder":
        return True
    encoder = getattr(args, "encoder_num_layers", None)
    return bool(encoder) and encoder != getattr(args, "num_layers", None)


def _megatron_layout_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's flags that lay layers out unevenly (its own placement builds them; a V refuses them)."""
    return [flag for flag, field in MEGATRON_LAYOUT_FLAGS if getattr(args, field, None)]


def check_layers(
    num_layers: int, schedule: Schedule, pad: bool, first: int | None = None, last: int | None = None
) -> None:
    """Every block of the schedule's placement gets its layers (two fewer in all with padding; the first and the
    last block ``first`` and ``last`` when given)."""
    try:
        layers_per_block(num_layers, schedule.placement, pad, first, last)
    except ValueError as error:
        raise ValueError(f"{schedule.name}: {error}") from None


def _refuse_zero_bubble_only_flags(args: argparse.Namespace) -> None:
    if getattr(args, "zero_bubble_max_pending_backward", None) is not None:
        raise ValueError("--zero-bubble-max-pending-backward needs --enable-zero-bubble")
    if getattr(args, "zero_bubble_memory_limit", None) is not None:
        *others, last = with_option("memory_limit")
        raise ValueError(f"--zero-bubble-memory-limit needs --pipeline-schedule {', '.join(others)} or {last}")
    if getattr(args, "zero_bubble_v_schedule_mem_setup", "zb") != "zb":
        raise ValueError("--zero-bubble-v-schedule-mem-setup needs --zero-bubble-v-schedule")
    for flag in ("breadth_first_micro_batches", "depth_first_micro_batches"):
        if getattr(args, flag, None) is not None:
            choices = " or ".join(_breadth_first_schedules())
            raise ValueError(f"--{flag.replace('_', '-')} needs --pipeline-schedule {choices}")
    if getattr(args, "enable_optimizer_post_validation", False):
        raise ValueError(
            "--enable-optimizer-post-validation needs a megatron-zb schedule (--enable-zero-bubble, "
            "--zero-bubble-v-schedule or --pipeline-schedule NAME): it redoes an iteration's first forwards when "
            "a step is undone, which megatron-core's own schedules cannot"
        )
    if getattr(args, "zero_bubble_save_costs", None):
        raise ValueError(
            "--zero-bubble-save-costs needs a zero-bubble schedule (--enable-zero-bubble, --zero-bubble-v-schedule "
            "or --pipeline-schedule NAME); megatron-core's own schedule is not timed"
        )
    refuse_zero_bubble_settings(args)


def _megatron_flags(message: str) -> str:
    for ours, theirs in _FLAG_NAMES.items():
        message = message.replace(ours, theirs)
    return message
