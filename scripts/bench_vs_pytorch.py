"""Benchmark (not a test): PyTorch's pipeline schedules next to ours, simulated alike at the same peak memory.

    python scripts/bench_vs_pytorch.py [--output docs/bench_vs_pytorch.md] [--quick]

PyTorch (torch.distributed.pipelining, the torch installed here) builds its orders without a
process group: each schedule class is constructed with stand-in stages and its
``pipeline_order`` is written as the CSV ``_dump_csv`` writes, then read with
``megatron_zb.schedule.torch_csv`` and validated. Schedule1F1B's ``pipeline_order`` drops the
last rank's first forward in torch 2.13, so its row uses the order ``_step_microbatches``
executes. Each PyTorch order is compared with the best of our schedules (every registered
one, with one, two or four chunks where it takes them; as it is, or planned with the PyTorch
order's peak as --memory-limit when it needs more) whose peak memory is at most the PyTorch
order's, separately on the two bubble metrics; a row where PyTorch is better on either is
marked LOSS. ``auto`` at that peak is one of ours too: it weighs every family at 1, 2 and 4
chunks and PyTorch's ZB-V, DualPipeV and interleaved zero-bubble orders by makespan.
"""

from __future__ import annotations

import argparse
import csv
import io
import platform
from dataclasses import dataclass, replace
from functools import cache
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import Schedule, ScheduleError
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names
from megatron_zb.schedule.simulate import Timeline, simulate
from megatron_zb.schedule.torch_csv import read_torch_csv
from megatron_zb.schedule.validate import check

TOLERANCE = 1e-9
# PyTorch schedule class -> stages per rank to run it with.
TORCH_SCHEDULES = {
    "Schedule1F1B": (1,),
    "ScheduleGPipe": (1,),
    "ScheduleInterleaved1F1B": (2, 4),
    "ScheduleLoopedBFS": (2, 4),
    "ScheduleInterleavedZeroBubble": (2, 4),
    "ScheduleZBVZeroBubble": (2,),
    "ScheduleDualPipeV": (2,),
}
OUR_CHUNKS = (None, 2, 4)


def unit_costs(p: int) -> CostModel:
    return CostModel(p)


def profile(w_over_b: float, comm: float, ends: float = 1.0):
    """T_F = T_B = 1 (``ends`` times that on the first and last stage), T_W = w_over_b T_B, T_comm ``comm``."""

    def costs(p: int) -> CostModel:
        scale = [ends if s in (0, p - 1) else 1.0 for s in range(p)]
        return CostModel(p, t_f=scale, t_b=scale, t_w=[w_over_b * x for x in scale], t_comm=comm)

    return costs


def gpt_costs(p: int) -> CostModel:
    """F 1.2 on the first and last stage (embedding, loss) else 1, B 1.1, W 0.7, comm 0.05."""
    return CostModel(p, t_f=[1.2 if s in (0, p - 1) else 1.0 for s in range(p)], t_b=1.1, t_w=0.7, t_comm=0.05)


COSTS = {
    "unit": unit_costs,
    "GPT-like": gpt_costs,
    "heavy ends": profile(0.5, 0.2, ends=1.5),
    "light W": profile(0.2, 0.2),
    "W = B": profile(1.0, 0.2),
}


def _stand_in_stages(p: int, per_rank: int) -> list[SimpleNamespace]:
    """What the schedule constructors read from rank 0's stages; they plan every rank's order."""
    return [
        SimpleNamespace(num_stages=p * per_rank, group_size=p, group_rank=0, stage_index=i, submod=None)
        for i in range(per_rank)
    ]


def executed_1f1b(p: int, m: int) -> dict[int, list]:
    """The order Schedule1F1B._step_microbatches runs: p - r warm-up forwards, then B and F alternate."""
    make = torch_schedules._Action
    order = {}
    for rank in range(p):
        warmup = min(m, p - rank)
        actions = [make(rank, torch_schedules.F, mb) for mb in range(warmup)]
        forward = warmup
        for backward in range(m):
            actions.append(make(rank, torch_schedules.B, backward))
            if forward < m:
                actions.append(make(rank, torch_schedules.F, forward))
                forward += 1
        order[rank] = actions
    return order


def torch_order(name: str, p: int, m: int, per_rank: int) -> dict[int, list]:
    """``pipeline_order`` of PyTorch's schedule (rank -> actions, None for idle steps); raises what torch raises."""
    cls = getattr(torch_schedules, name)
    stages = _stand_in_stages(p, per_rank)
    schedule = cls(stages[0], m) if per_rank == 1 else cls(stages, m)
    return executed_1f1b(p, m) if name == "Schedule1F1B" else schedule.pipeline_order


def dump_csv(order: dict[int, list]) -> str:
    """The text ``_dump_csv`` writes for ``order`` (a cell per action, empty for None)."""
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(order):
        writer.writerow(["" if action is None else str(action) for action in order[rank]])
    return out.getvalue()


def imported(name: str, p: int, m: int, per_rank: int) -> Schedule:
    schedule, _ = read_torch_csv(dump_csv(torch_order(name, p, m, per_rank)), f"{name}/{per_rank}")
    check(schedule)
    return replace(schedule, overlapped=())  # PyTorch's runtime runs OVERLAP_F_B's parts in turn by default


@dataclass(frozen=True)
class Ours:
    label: str
    timeline: Timeline


@cache
def _built(name: str, p: int, m: int, chunks: int | None, costs_label: str, limit: float | None) -> Schedule | None:
    try:
        return build(name, ScheduleSpec(p, m, chunks, COSTS[costs_label](p), limit), suggest=False)
    except ScheduleError:
        return None


def our_schedules(p: int, m: int, costs_label: str, limit: float) -> list[Ours]:
    """Every schedule of ours that fits ``limit``: as it is, or else planned with it as --memory-limit.

    Schedules that keep more than one copy of the weights (BitPipe) are left out: their activations
    may fit, their weights take twice PyTorch's.
    """
    found = []
    for name in (n for n in names() if not get(n).composite and get(n).weight_copies == 1):
        for chunks in OUR_CHUNKS:
            label = name + (f" c{chunks}" if chunks else "")
            unlimited = _timeline(name, p, m, chunks, costs_label, None)
            if unlimited is not None and max(unlimited.peak_memory) <= limit + TOLERANCE:
                found.append(Ours(label, unlimited))
                continue  # it fits as it is: a limit it already meets would not change it
            planned = _timeline(name, p, m, chunks, costs_label, limit)
            if planned is not None and max(planned.peak_memory) <= limit + TOLERANCE:
                found.append(Ours(f"{label} L{limit:g}", planned))
    chosen = _timeline("auto", p, m, None, costs_label, limit)  # every chunk count, ranked by makespan
    if chosen is not None:
        found.append(Ours(f"{chosen.schedule.name} L{limit:g}", chosen))
    return found


@cache
def _timeline(name: str, p: int, m: int, chunks: int | None, costs_label: str, limit: float | None) -> Timeline | None:
    schedule = _built(name, p, m, chunks, costs_label, limit)
    return None if schedule is None else simulate(schedule, COSTS[costs_label](p))


def _best(found: list[Ours], metric: str) -> Ours | None:
    return min(found, key=lambda o: (getattr(o.timeline, metric), o.label), default=None)


def _cell(ours: Ours | None, metric: str) -> str:
    return "none fits" if ours is None else f"{getattr(ours.timeline, metric):.2%} {ours.label}"


def _loses(theirs: Timeline, ours: Ours | None, metric: str) -> bool:
    return ours is None or getattr(theirs, metric) < getattr(ours.timeline, metric) - TOLERANCE


def row(name: str, per_rank: int, p: int, m: int, costs_label: str) -> tuple[str, bool]:
    """One Markdown row, and whether PyTorch's order beats ours there."""
    head = f"| {m} | {name} | {per_rank} |"
    try:
        schedule = imported(name, p, m, per_rank)
    except (ValueError, RuntimeError, AssertionError) as error:  # torch refuses the setting
        reason = " ".join(str(error).split())[:90]
        return head + f" — | refused by PyTorch: {reason} | | | | | |", False
    theirs = simulate(schedule, COSTS[costs_label](p))
    peak = max(theirs.peak_memory)
    found = our_schedules(p, m, costs_label, peak)
    span, full = _best(found, "bubble_rate"), _best(found, "bubble_rate_makespan")
    metrics = (("stage span", span, "bubble_rate"), ("makespan", full, "bubble_rate_makespan"))
    lost = [label for label, ours, metric in metrics if _loses(theirs, ours, metric)]
    marker = "LOSS (" + ", ".join(lost) + ")" if lost else ""
    cells = [
        f"{peak:g}",
        f"{theirs.bubble_rate:.2%}",
        _cell(span, "bubble_rate"),
        f"{theirs.bubble_rate_makespan:.2%}",
        _cell(full, "bubble_rate_makespan"),
        f"{theirs.makespan:.6g}",
        marker,
    ]
    return head + " " + " | ".join(cells) + " |", bool(lost)


HEADER = [
    "| m | PyTorch schedule | stages per rank | peak | PyTorch stage-span bubble | ours, best at that peak "
    "| PyTorch makespan bubble | ours, best at that peak | PyTorch makespan | loses |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the tables to this Markdown file")
    parser.add_argument("--quick", action="store_true", help="p=4 only")
    args = parser.parse_args()
    lines = [
        "# Our schedules next to PyTorch's",
        "",
        f"Measured with `python scripts/bench_vs_pytorch.py --output docs/bench_vs_pytorch.md` (torch "
        f"{torch.__version__}, {platform.machine()}, Python {platform.python_version()}). Simulated, not run: "
        "each PyTorch order is built without a process group, read from the CSV `_dump_csv` writes "
        "(`megatron_zb/schedule/torch_csv.py`), validated, and simulated with our simulator and costs next to the "
        "best of our schedules whose peak activation memory is at most the PyTorch order's (every registered "
        "schedule, with 1, 2 or 4 chunks where it takes them; as it is, or planned with that peak as "
        "`--memory-limit` when it needs more; `c2` = 2 chunks per rank, `L8` = planned at limit 8), separately for "
        "each metric. "
        "Schedule1F1B is the order it executes (its `pipeline_order` drops the last rank's first forward in "
        "torch 2.13). Memory: F +1, B -0.5, W -0.5 per stage; peak in one microbatch's activations of a stage.",
        "",
        "`auto` at that peak is among ours (every family at 1, 2 and 4 chunks and PyTorch's ZB-V, DualPipeV and "
        "interleaved zero-bubble orders, by makespan).",
        "",
        "Costs: unit (T_F = T_B = T_W = 1, no latency); GPT-like (T_F 1.2 on the first and last stage, else 1; "
        "T_B 1.1; T_W 0.7; T_comm 0.05); heavy ends (T_F = T_B = 1, 1.5 on the first and last stage, T_W/T_B 0.5, "
        "T_comm 0.2); light W (T_F = T_B = 1, T_W 0.2, T_comm 0.2); W = B (T_F = T_B = T_W = 1, T_comm 0.2). "
        "LOSS marks a row where PyTorch's order has the smaller bubble.",
    ]
    losses = []
    for costs_label in COSTS:
        for p in (4,) if args.quick else (4, 8):
            lines += ["", f"## {costs_label} costs, p={p}", "", *HEADER]
            for m in (p, p + p // 2, 2 * p, 3 * p, 4 * p, 8 * p):
                for name, per_rank_options in TORCH_SCHEDULES.items():
                    for per_rank in per_rank_options:
                        text, lost = row(name, per_rank, p, m, costs_label)
                        lines.append(text)
                        print(f"{costs_label} p={p} " + text, flush=True)
                        if lost:
                            losses.append(f"{costs_label} p={p} " + text)
    lines += ["", "## Rows where PyTorch's order wins", ""]
    lines += [f"- {entry}" for entry in losses] or ["None: on every row our best schedule at that peak is as good."]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
