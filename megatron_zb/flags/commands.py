"""The options of megatron-zb's own commands: plan and compare (the planner, no torch) and verify.

The planner parses its numbers with ``table.argument_type`` (argparse refuses a bad one by name); it
shares the breadth-first knobs with the zero-bubble flags. verify's options come before the ``--`` that
starts the line it checks.
"""

from __future__ import annotations

from dataclasses import replace

from .launcher import LAUNCHER_FLAGS
from .table import COUNT, FINITE, NON_NEGATIVE, PLANNER, POSITIVE, VERIFY, Flag, Range
from .zero_bubble import ZERO_BUBBLE_FLAGS

SHARE = Range(-1, 1)  # a share of a time, which may also cost: -1 .. 1

# What plan --format writes.
FORMATS = ("text", "json", "svg", "html", "chrome-trace", "torch-csv")
VERIFY_ITERATIONS = 4
LOOPS = ("megatron-lm", "launcher")  # verify --verify-loop: whose training loop runs the copies


def _planner(title: str, *rows: Flag) -> tuple[Flag, ...]:
    return tuple(replace(row, group=title, honoured=PLANNER) for row in rows)


def _stage_numbers(option: str, help: str) -> Flag:
    """A number per full stage: one, or a comma list with one value per stage."""
    return Flag(option, help, type=float, comma_list=True)


COSTS = "costs, per full stage (a number, or a comma list with one value per stage)"
MEMORY = "memory, in one microbatch's activations of a full stage"
DATA_PARALLEL = (
    "data parallelism: given any of these, schedules are lowered with each chunk's gradient reduction (and with "
    "--zero3 its weight gathers) and simulated with them"
)
_ZB = {row.option: row for row in ZERO_BUBBLE_FLAGS}

# The setting every planner command plans for: pp, microbatches, chunks, costs, memory.
SETTING = (
    *_planner(
        "",
        Flag("--pp", "pipeline-parallel ranks (required without --costs-from)", type=int, range=COUNT),
        Flag("--microbatches", "microbatches per iteration (required without --costs-from)", type=int, range=COUNT,
             aliases=("-m",)),
        Flag("--chunks", "model chunks per rank (default: each schedule's own)", type=int, range=COUNT),
    ),
    *_planner(
        COSTS,
        _stage_numbers("--cost-f", "forward time T_F (default 1)"),
        _stage_numbers("--cost-b", "input-gradient backward time T_B (default 1)"),
        _stage_numbers("--cost-w", "weight-gradient backward time T_W (default 1)"),
        _stage_numbers("--cost-bw", "time of a fused backward (a BW pass, B and W in one, as 1F1B runs it) where it "
                       "differs from T_B + T_W (default T_B + T_W)"),
        Flag("--cost-comm", "latency per cross-rank transfer (default 0)", type=float, range=FINITE),
        _stage_numbers("--cost-a2a", "expert-parallel all-to-all time of one microbatch in one direction (dispatch "
                       "and combine of the stage's MoE layers), a part of T_F and of T_B (default 0)"),
        Flag("--cost-overlap", "share of the hideable time an overlapped F&B pair hides (--overlap-f-b): 1 two ideal "
             "streams, 0 none, negative where a pair runs slower than its two passes (default 1)", type=float,
             range=SHARE),
        Flag("--costs-from", "the costs measured in training (--zero-bubble-save-costs FILE), in ms; pp, microbatches "
             "and the memory limit default to the run's", metavar="FILE"),
    ),
    *_planner(
        MEMORY,
        _stage_numbers("--mem-f", "allocated by F (default 1)"),
        _stage_numbers("--mem-b", "freed by B, negative (default -0.5)"),
        _stage_numbers("--mem-w", "freed by W, negative (default -0.5)"),
        Flag("--memory-limit", "per-rank activation memory limit, > 0 (default: none)", type=float, range=POSITIVE,
             why="leave it out for no limit"),
    ),
    *_planner(
        DATA_PARALLEL,
        _stage_numbers("--cost-dp", "time of one gather or gradient reduction of a full stage's weights (default 0)"),
        _stage_numbers("--mem-param", "memory of a full stage's gathered weights while gathered, in the memory unit "
                       "above (default 0)"),
        Flag("--zero3", "ZeRO-3: gather a chunk's weights before each run of its passes and release them after it",
             switch=True),
        Flag("--prefetch", "with --zero3: issue each gather this many compute passes before its first use (default 1)",
             type=int, range=NON_NEGATIVE),
    ),
    *_planner(
        "",
        Flag("--overlap-f-b", "run adjacent F and B (or BW) of a rank as one overlapped step where that shortens the "
             "iteration, each one's expert-parallel all-to-all behind the other's compute (DualPipe's overlapped "
             "F&B); needs --cost-a2a or measured all-to-all times", switch=True),
    ),
    *(replace(_ZB[option], group="breadth-first schedules")
      for option in ("--breadth-first-micro-batches", "--depth-first-micro-batches")),
    *_planner(
        "",
        Flag("--post-validation", "optimizer post-validation (Megatron's --enable-optimizer-post-validation), so "
             "iterations overlap: auto picks by stage span instead of makespan; plan --iterations N >= 2 draws the "
             "iterations that way (each rank steps once it has its gradients and the partial grad norm of the ranks "
             "before it)", switch=True),
    ),
)  # fmt: skip
OUTPUT = _planner("output", Flag("--output", "write to this file instead of standard output", aliases=("-o",)))[0]

PLAN = (
    *_planner(
        "",
        Flag("--schedule", "schedule name; see `megatron-zb list` (default with --costs-from: the run's schedule)"),
        Flag("--from-file", "validate, simulate and draw the orders in FILE instead of a named schedule: our JSON "
             "(--format json) or PyTorch's schedule CSV (compute only or with communication); pp and microbatches "
             "come from the file", metavar="FILE"),
    ),
    *SETTING,
    *_planner(
        "",
        Flag("--refine-seconds", "automatic schedules: improve the heuristic with the CP-SAT solver for up to N "
             "seconds (needs megatron-zb[refine]); never worse than the heuristic", type=float, default=0.0,
             metavar="N", range=NON_NEGATIVE),
    ),
    *_planner(
        "several iterations",
        Flag("--iterations", "simulate N iterations back to back and draw them all; with N >= 2, text and json also "
             "give the time per iteration with a synchronising optimizer step and with post-validation (default 1)",
             type=int, default=1, metavar="N", range=COUNT),
    ),
    *_planner(
        "output",
        Flag("--format", "default: text; torch-csv writes the orders as PyTorch's compute-only schedule CSV (_load_csv "
             "reads it)", choices=FORMATS, default="text"),
    ),
    OUTPUT,
    *_planner(
        "output",
        Flag("--width", "text format: at most this many columns for the timeline", type=int, range=COUNT),
        Flag("--color", "text format: ANSI colors by pass kind", switch=True),
    ),
)  # fmt: skip

COMPARE = (
    *SETTING,
    *_planner("output", Flag("--format", "default: text", choices=("text", "json"), default="text")),
    OUTPUT,
    *_planner(
        "output",
        Flag("--plot", "also draw bubble vs peak memory (with --sweep: efficiency vs microbatches): FILE.svg, or "
             "FILE.png (needs rsvg-convert)", metavar="FILE"),
    ),
    *_planner(
        "",
        Flag("--sweep", "simulate every schedule at each of these microbatch counts instead of --microbatches and "
             "print its efficiency (1 - makespan bubble) per count: iteration time against batch per GPU", type=int,
             comma_list=True, metavar="M1,M2,...", range=COUNT),
    ),
)  # fmt: skip

VERIFY_FLAGS = tuple(
    replace(row, honoured=VERIFY)
    for row in (
        Flag("--megatron-lm", "the Megatron-LM checkout whose pretrain() and parser to use (default: the installed "
             "megatron.training where megatron-core >= 0.17 ships it, else megatron-zb's own loop)", nargs="?",
             const="", metavar="PATH"),
        Flag("--verify-loop", "whose training loop runs the copies (default: megatron-lm where importable, else "
             "launcher)", choices=LOOPS),
        Flag("--verify-iters", f"iterations per run (default {VERIFY_ITERATIONS})", type=int,
             default=VERIFY_ITERATIONS, range=Range(2)),
        Flag("--verify-tolerance", "largest relative difference accepted (default 1e-5 in fp32, 1e-2 with "
             "--bf16/--fp16; 0: identical)", type=float),
        Flag("--verify-data-parallel", "data-parallel copies to run (default 1; processes)", type=int, default=1,
             range=COUNT),
    )
)  # fmt: skip

# Every command's flags, as its parser has them: no option twice in one.
COMMANDS = {
    "add_args": ZERO_BUBBLE_FLAGS,
    "train": (*LAUNCHER_FLAGS, *ZERO_BUBBLE_FLAGS),
    "plan": PLAN,
    "compare": COMPARE,
    "verify": VERIFY_FLAGS,
}
