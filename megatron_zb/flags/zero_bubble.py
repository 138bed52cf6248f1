"""The zero-bubble flags: the group ``megatron_zb.add_args`` adds to any Megatron-LM parser (and the launcher's).

The names and meanings follow the zero-bubble reference implementation, so launch scripts written
for it run unchanged; ``--pipeline-schedule`` and ``--zero-bubble-memory-limit`` are ours. Help texts
name {schedules}, {file_prefix} and {memory_limit_schedules}, which ``megatron.args`` fills from the
schedule registry; ``--pipeline-schedule`` is parsed by its "schedule" type, from the same place.
"""

from __future__ import annotations

from .table import COUNT, POSITIVE, TIMEOUT_SECONDS, ZERO_BUBBLE, Flag

GROUP = "zero bubble (megatron-zb)"
# --zero-bubble-v-schedule-mem-setup -> the V schedule it selects
V_MEMORY_SETUPS = {"zb": "zb-v", "half": "v-half", "min": "v-min"}
SAME_INIT = "--zero-bubble-placement-independent-init"
KEYED_DROPOUT = "--zero-bubble-order-independent-dropout"
OVERLAP_F_B = "--zero-bubble-overlap-f-b"
PENDING_AUTO = (
    "'auto' (a limit adapted to free GPU memory) is not supported; give a number of microbatches, e.g. the pipeline "
    "size (ZB-1p) or twice it (ZB-2p), or use --zero-bubble-memory-limit"
)
SCALED_LIMIT = "keeps the limit at {ratio:.3g} x the pipeline size"


def _zb(option: str, help: str, **fields) -> Flag:
    return Flag(option, help, group=GROUP, honoured=ZERO_BUBBLE, **fields)


ZERO_BUBBLE_FLAGS = (
    _zb("--enable-zero-bubble", "run an automatic zero-bubble schedule (ZB-1p/ZB-2p-like, memory set by "
        "--zero-bubble-max-pending-backward) instead of megatron-core's 1F1B", switch=True),
    _zb("--zero-bubble-v-schedule", "run a V-shape schedule (two model chunks per rank); implies --enable-zero-bubble",
        switch=True),
    _zb("--enable-bitpipe-schedule", "run BitPipe (two mirrored V pipelines, each block's weights on two ranks; "
        "BitPipe's own flag): --pipeline-schedule bitpipe", switch=True),
    _zb("--zero-bubble-v-schedule-mem-setup", "memory of the V schedule: zb (ZB-V, 1F1B's memory), half (V-Half), "
        "min (V-Min); default zb", choices=tuple(sorted(V_MEMORY_SETUPS)), default="zb"),
    _zb("--zero-bubble-max-pending-backward", "memory limit of the automatic zero-bubble schedule, in microbatches "
        "whose backward is pending: pipeline size => ZB-1p, twice the pipeline size => ZB-2p (default: the pipeline "
        "size); no effect on V schedules", type=int, metavar="K", range=COUNT, checked_when_parsed=True,
        refused_values=(("auto", PENDING_AUTO),), verify=SCALED_LIMIT),
    _zb("--zero-bubble-pipeline-timers-start-iter", "first training iteration of this process whose F/B/W passes are "
        "timed to re-plan the schedule (default 100)", type=int, default=100, needs_schedule=True),
    _zb("--zero-bubble-pipeline-timers-end-iter", "last timed iteration: after it every rank agrees on the measured "
        "per-stage costs and the schedule is re-planned once with them (default 110)", type=int, default=110,
        needs_schedule=True),
    _zb("--no-zero-bubble-replan", "keep the schedule planned at start (unit costs): time no passes and never "
        "re-plan", switch=True),
    _zb(OVERLAP_F_B, "MoE with expert parallelism: run one microbatch's forward beside another's backward on a rank "
        "where the re-planned schedule gains (DualPipe's overlapped F&B), so each one's expert-parallel all-to-all "
        "waits while the other computes; the pairs are placed when the schedule is re-planned with the measured "
        "all-to-all time, and train equal to the passes one after the other", switch=True, default=False,
        needs_schedule=True),
    _zb("--zero-bubble-save-costs", "after re-planning, the first rank writes the measured costs to FILE (JSON), for "
        "`megatron-zb plan --costs-from FILE`", metavar="FILE", verify="verify writes only in its folder"),
    _zb("--allow-padding-num-layers", "let --num-layers + 2 divide by the pipeline blocks: the blocks holding the "
        "embedding and the loss get one layer fewer", switch=True),
    _zb("--enable-optimizer-post-validation", "step the optimizer without the global grad-norm/inf-nan all-reduce: "
        "stages pass the statistics along the pipeline and step at once; a step that should have been skipped or "
        "clipped is undone and redone before the next iteration's first backward", switch=True),
    _zb("--optimizer-post-validation-rollback", "how a wrong step is undone: exact (a copy of the main parameters and "
        "optimizer state; bit-identical to the synchronous step) or in-place (Adam run backwards; no copy, results "
        "within rounding); default exact", choices=("exact", "in-place"), default="exact", needs_schedule=True),
    _zb("--pipeline-schedule", "run this megatron-zb schedule ({schedules}), or {file_prefix}PATH for the orders in a "
        "schedule file (megatron-zb plan --format json or torch-csv, or PyTorch's schedule CSV) planned for this pp, "
        "microbatches and chunks; implies --enable-zero-bubble", type="schedule", metavar="NAME"),
    _zb("--zero-bubble-memory-limit", "per-rank activation memory limit of the automatic schedules "
        "({memory_limit_schedules}), in one microbatch's activations of a full stage (1F1B needs the pipeline size)",
        type=float, metavar="M", range=POSITIVE, verify=SCALED_LIMIT),
    _zb("--breadth-first-micro-batches", "breadth-first schedules: microbatches per breadth-first group (default: all "
        "of them); each group passes through a model chunk before the next chunk runs", type=int, metavar="N",
        range=COUNT),
    _zb("--depth-first-micro-batches", "breadth-first schedules: how many breadth-first groups run one after the "
        "other (default 1); microbatches = breadth-first x depth-first micro-batches", type=int, metavar="N",
        range=COUNT),
    _zb("--zero-bubble-p2p-timeout", "a pipeline send or receive that waits longer fails, naming the rank, pass and "
        "microbatch; it may only shorten --distributed-timeout-minutes, which bounds every wait (default: that "
        "timeout)", type=float, metavar="SECONDS", range=TIMEOUT_SECONDS, needs_schedule=True,
        refusal="{option} must be a finite number of seconds {range}, got {value} (leave it out: pipeline waits then "
        "use --distributed-timeout-minutes)"),
    _zb(SAME_INIT, "Megatron-LM: draw every initial weight from (--seed, its name in the unpipelined model) instead of "
        "each rank's random stream, so runs with different schedules, placements or pipeline sizes start from the "
        "same model (e.g. zb-v against megatron-core's 1F1B); works with megatron-core's schedules too (megatron-zb "
        "train always initialises this way)", switch=True,
        verify="both runs draw every weight from the seed and its name, whatever the placement"),
    _zb("--enable-zb-runtime", "the reference implementation's switch for its zero-bubble runtime; accepted with a "
        "note so its scripts run unchanged (megatron-zb's runtime runs every schedule)", switch=True),
    _zb(KEYED_DROPOUT, "draw every layer's dropout masks from (--seed, the microbatch's forward, the layer's number) "
        "instead of each rank's stream in the order it runs forwards, so that any schedule, re-plan or pipeline split "
        "draws the same masks (e.g. zb-v against megatron-core's 1F1B); works with megatron-core's schedules too",
        switch=True, verify="both runs draw each layer's dropout masks from the seed, the microbatch "
        "and the layer, whatever order the schedule runs the microbatches in"),
)  # fmt: skip
