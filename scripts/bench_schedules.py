"""Benchmark (not a test): bubble rates of every schedule, and the planning time of the searched ones.

    python scripts/bench_schedules.py [--output docs/bench_schedules.md] [--quick]

Two cost models: unit costs (T_F = T_B = T_W = 1, no comm latency) and GPT-like stages
(T_B = 1.1 T_F, T_W = 0.6 T_B, T_comm = 3% of T_F, first and last stage 20% heavier).
Memory uses the defaults (F allocates 1 stage activation, B and W free half each). Targets:
zb-2p for pp=32, m=256 planned (generated + validated) in under 1 s, v-auto in under 5 s.
"""

from __future__ import annotations

import argparse
import platform
import time

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names
from megatron_zb.schedule.simulate import simulate


def gpt_costs(p: int) -> CostModel:
    scale = [1.2 if stage in (0, p - 1) else 1.0 for stage in range(p)]
    return CostModel(p, t_f=scale, t_b=[1.1 * x for x in scale], t_w=[0.66 * x for x in scale], t_comm=0.03)


COSTS = {"unit": lambda p: CostModel(p), "GPT-like": gpt_costs}


def row(p: int, m: int, costs: CostModel, schedules: list[str], limits: dict[str, float]) -> list[str]:
    cells = []
    for name in schedules:
        try:
            timeline = simulate(build(name, ScheduleSpec(p, m, costs=costs, memory_limit=limits.get(name))), costs)
        except ScheduleError:
            cells.append("—")
            continue
        cells.append(f"{timeline.bubble_rate:.1%} ({max(timeline.peak_memory):g})")
    return cells


def timing(name: str, p: int, m: int, costs: CostModel, limit: float | None) -> float:
    start = time.perf_counter()
    build(name, ScheduleSpec(p, m, costs=costs, memory_limit=limit))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the tables to this Markdown file")
    parser.add_argument("--quick", action="store_true", help="pp in {4, 8} only")
    args = parser.parse_args()
    sizes = [(p, k * p) for p in ((4, 8) if args.quick else (4, 8, 16, 32)) for k in (2, 3, 4, 8)]
    schedules = [name for name in names() if not get(name).composite]
    lines = [
        f"Measured with `python scripts/bench_schedules.py` on {platform.machine()}, "
        f"Python {platform.python_version()}.",
        "Cells: stage-span bubble (peak activation memory per rank, in one microbatch's activations of a stage).",
        "v-auto runs at half of 1f1b's memory (--memory-limit pp/2); zb-auto unlimited.",
    ]
    for label, make in COSTS.items():
        lines += ["", f"### {label} costs", "", "| pp | m | " + " | ".join(schedules) + " |"]
        lines.append("|---|---|" + "---|" * len(schedules))
        for p, m in sizes:
            cells = row(p, m, make(p), schedules, {"v-auto": p / 2})
            lines.append(f"| {p} | {m} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    p, m = (8, 64) if args.quick else (32, 256)
    lines += ["", f"### Planning time, pp={p}, m={m} (generate + validate, seconds)", ""]
    lines += ["| schedule | unit | GPT-like |", "|---|---|---|"]
    for name, limit in (("zb-1p", None), ("zb-2p", None), ("zb-v", None), ("v-half", None), ("v-min", None)) + (
        ("v-auto", p / 2),
        ("v-auto", 3 * p / 4),
    ):
        label = name if limit is None else f"{name} (limit {limit:g})"
        seconds = [timing(name, p, m, make(p), limit) for make in COSTS.values()]
        lines.append(f"| {label} | " + " | ".join(f"{s:.2f}" for s in seconds) + " |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print()
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write("# Schedule bubble rates and planning time\n\n" + table + "\n")


if __name__ == "__main__":
    main()
