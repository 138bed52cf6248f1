"""Zero-bubble flags for Megatron-LM's argument parser, and the checks that refuse bad combinations.

The flag names and meanings follow the zero-bubble reference implementation, so launch
scripts written for it run unchanged; ``--pipeline-schedule`` and ``--zero-bubble-memory-limit``
are ours. ``schedule_settings(args)`` turns a parsed namespace (Megatron-LM's names) into the
schedule to run, or refuses it before any process group exists.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..checks import check_zero_bubble_numbers, refuse_zero_bubble_settings, wait_timeout_s
from ..schedule import Schedule, ScheduleError, ScheduleSpec, names
from ..schedule.placement import Placement
from ..schedule.registry import get, with_option
from ..schedule.schedule_file import FILE_PREFIX, build_schedule, load_schedule, refuse_other_setting
from .layer_split import layers_per_block
from .megatron_mapping import MEGATRON_LAYOUT_FLAGS, foreign_placement

V_MEMORY_SETUPS = {"zb": "zb-v", "half": "v-half", "min": "v-min"}
# Schedule-core option names, as a Megatron user knows them.
_FLAG_NAMES = {"--chunks": "--virtual-pipeline-model-parallel-size", "--memory-limit": "--zero-bubble-memory-limit"}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the zero-bubble group; usable as Megatron-LM's ``extra_args_provider``."""
    group = parser.add_argument_group(title="zero bubble (megatron-zb)")
    group.add_argument(
        "--enable-zero-bubble",
        action="store_true",
        help="run an automatic zero-bubble schedule (ZB-1p/ZB-2p-like, memory set by "
        "--zero-bubble-max-pending-backward) instead of megatron-core's 1F1B",
    )
    group.add_argument(
        "--zero-bubble-v-schedule",
        action="store_true",
        help="run a V-shape schedule (two model chunks per rank); implies --enable-zero-bubble",
    )
    group.add_argument(
        "--enable-bitpipe-schedule",
        action="store_true",
        help="run BitPipe (two mirrored V pipelines, each block's weights on two ranks; BitPipe's own flag): "
        "--pipeline-schedule bitpipe",
    )
    group.add_argument(
        "--zero-bubble-v-schedule-mem-setup",
        choices=sorted(V_MEMORY_SETUPS),
        default="zb",
        help="memory of the V schedule: zb (ZB-V, 1F1B's memory), half (V-Half), min (V-Min); default zb",
    )
    group.add_argument(
        "--zero-bubble-max-pending-backward",
        type=_pending_backward,
        default=None,
        metavar="K",
        help="memory limit of the automatic zero-bubble schedule, in microbatches whose backward is pending: "
        "pipeline size => ZB-1p, twice the pipeline size => ZB-2p (default: the pipeline size); "
        "no effect on V schedules",
    )
    group.add_argument(
        "--zero-bubble-pipeline-timers-start-iter",
        type=int,
        default=100,
        help="first training iteration of this process whose F/B/W passes are timed to re-plan the schedule "
        "(default 100)",
    )
    group.add_argument(
        "--zero-bubble-pipeline-timers-end-iter",
        type=int,
        default=110,
        help="last timed iteration: after it every rank agrees on the measured per-stage costs and the schedule "
        "is re-planned once with them (default 110)",
    )
    group.add_argument(
        "--no-zero-bubble-replan",
        action="store_true",
        help="keep the schedule planned at start (unit costs): time no passes and never re-plan",
    )
    group.add_argument(
        "--zero-bubble-save-costs",
        default=None,
        metavar="FILE",
        help="after re-planning, the first rank writes the measured costs to FILE (JSON), for "
        "`megatron-zb plan --costs-from FILE`",
    )
    group.add_argument(
        "--allow-padding-num-layers",
        action="store_true",
        help="let --num-layers + 2 divide by the pipeline blocks: the blocks holding the embedding and the loss "
        "get one layer fewer",
    )
    group.add_argument(
        "--enable-optimizer-post-validation",
        action="store_true",
        help="step the optimizer without the global grad-norm/inf-nan all-reduce: stages pass the statistics "
        "along the pipeline and step at once; a step that should have been skipped or clipped is undone and redone "
        "before the next iteration's first backward",
    )
    group.add_argument(
        "--optimizer-post-validation-rollback",
        choices=("exact", "in-place"),
        default="exact",
        help="how a wrong step is undone: exact (a copy of the main parameters and optimizer state; bit-identical "
        "to the synchronous step) or in-place (Adam run backwards; no copy, results within rounding); default exact",
    )
    group.add_argument(
        "--pipeline-schedule",
        type=_schedule_choice,
        default=None,
        metavar="NAME",
        help=f"run this megatron-zb schedule ({', '.join(names())}), or {FILE_PREFIX}PATH for the orders in a "
        "schedule file (megatron-zb plan --format json or torch-csv, or PyTorch's schedule CSV) planned for this "
        "pp, microbatches and chunks; implies --enable-zero-bubble",
    )
    group.add_argument(
        "--zero-bubble-memory-limit",
        type=float,
        default=None,
        metavar="M",
        help=f"per-rank activation memory limit of the automatic schedules ({', '.join(with_option('memory_limit'))}), "
        "in one microbatch's activations of a full stage (1F1B needs the pipeline size)",
    )
    group.add_argument(
        "--breadth-first-micro-batches",
        type=int,
        default=None,
        metavar="N",
        help="breadth-first schedules: microbatches per breadth-first group (default: all of them); each group "
        "passes through a model chunk before the next chunk runs",
    )
    group.add_argument(
        "--depth-first-micro-batches",
        type=int,
        default=None,
        metavar="N",
        help="breadth-first schedules: how many breadth-first groups run one after the other (default 1); "
        "microbatches = breadth-first x depth-first micro-batches",
    )
    group.add_argument(
        "--zero-bubble-p2p-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a pipeline send or receive that waits longer fails, naming the rank, pass and microbatch; it may only "
        "shorten --distributed-timeout-minutes, which bounds every wait (default: that timeout)",
    )
    group.add_argument(
        "--zero-bubble-placement-independent-init",
        action="store_true",
        help="Megatron-LM: draw every initial weight from (--seed, its name in the unpipelined model) instead of "
        "each rank's random stream, so runs with different schedules, placements or pipeline sizes start from the "
        "same model (e.g. zb-v against megatron-core's 1F1B); works with megatron-core's schedules too "
        "(megatron-zb train always initialises this way)",
    )
    group.add_argument(
        "--enable-zb-runtime",
        action="store_true",
        help="the reference implementation's switch for its zero-bubble runtime; accepted with a note so its scripts "
        "run unchanged (megatron-zb's runtime runs every schedule)",
    )
    group.add_argument(
        "--zero-bubble-order-independent-dropout",
        action="store_true",
        help="draw every layer's dropout masks from (--seed, the microbatch's forward, the layer's number) instead of "
        "each rank's stream in the order it runs forwards, so that any schedule, re-plan or pipeline split draws the "
        "same masks (e.g. zb-v against megatron-core's 1F1B); works with megatron-core's schedules too",
    )
    return parser


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


def _pending_backward(text: str) -> int:
    if text == "auto":
        raise argparse.ArgumentTypeError(
            "'auto' (a limit adapted to free GPU memory) is not supported; give a number of microbatches, "
            "e.g. the pipeline size (ZB-1p) or twice it (ZB-2p), or use --zero-bubble-memory-limit"
        )
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of microbatches, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 microbatch, got {value}")
    return value


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
    if not layout or foreign_placement(schedule.placement) is not None:  # else Megatron-LM's validate_args checks
        check_layers(args.num_layers, schedule, pad)
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
    for flag, value in (("--breadth-first-micro-batches", breadth), ("--depth-first-micro-batches", depth)):
        if value is not None and (value < 1 or microbatches % value):
            raise ValueError(
                f"{flag} {value} must be a divisor of the {microbatches} microbatches per iteration "
                "(global batch / (micro batch x data-parallel size)): microbatches = breadth-first x depth-first"
            )
    if breadth is not None and depth is not None and breadth * depth != microbatches:
        raise ValueError(
            f"--breadth-first-micro-batches {breadth} x --depth-first-micro-batches {depth} = {breadth * depth}, "
            f"not the {microbatches} microbatches per iteration; give one of them, or two that multiply to it"
        )
    return breadth if breadth is not None else (microbatches // depth if depth is not None else None)


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
    if args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be at least 1 (samples per microbatch), got {args.micro_batch_size}")
    per_step = args.micro_batch_size * dp
    global_batch = getattr(args, "global_batch_size", None)
    global_batch = per_step if global_batch is None else global_batch
    if global_batch < 1:
        raise ValueError(
            f"--global-batch-size must be at least 1 (or left out: micro batch x data parallel), got {global_batch}"
        )
    if global_batch % per_step:
        nearest = per_step * max(1, global_batch // per_step)
        raise ValueError(
            f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {args.micro_batch_size} "
            f"x data-parallel size {dp} = {per_step}; use a multiple such as {nearest}"
        )
    return global_batch // per_step


def _refuse_unsupported_models(args: argparse.Namespace) -> None:
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ValueError(
            "megatron-zb schedules do not support --context-parallel-size > 1 yet; use tensor or data parallelism, "
            "or megatron-core's own schedule (drop the zero-bubble flags)"
        )
    if getattr(args, "num_experts", None):
        raise ValueError(
            "megatron-zb schedules do not support MoE models (--num-experts) yet; drop --num-experts, or the "
            "zero-bubble flags to run megatron-core's own schedule"
        )
    if getattr(args, "mtp_num_layers", None):
        raise ValueError("megatron-zb schedules do not support multi-token prediction (--mtp-num-layers) yet")
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


def check_layers(num_layers: int, schedule: Schedule, pad: bool) -> None:
    """Every block of the schedule's placement gets its layers (two fewer in all with padding)."""
    try:
        layers_per_block(num_layers, schedule.placement, pad)
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
