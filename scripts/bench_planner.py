"""Benchmark (not a test): how long planning takes.

    python scripts/bench_planner.py [--repeat 3] [--output docs/bench_planner.md]

Two tables. The searched schedules (zb-2p, zb-v, v-auto and the rest) with the ZB paper's
measured profile (T_F 18522, T_B 18086, T_W 9337, T_comm 601; memory F +1, B -0.55, W -0.45):
generation, and validation as ``build`` runs it, in CPU seconds of this process (best of
--repeat), so that other work on a shared machine does not count. Targets: zb-2p and zb-v at
pp=32, m=256 under 1 s, v-auto under 3 s, pp=64, m=512 under 5 s. Then the handmade
generators, plan + validate + simulate.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.registry import ScheduleSpec, build, get
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import check

SIZES = [(p, m) for p in (8, 32, 64) for m in (4 * p, 8 * p)]
HANDMADE = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"]
# (pp, m, schedule, --memory-limit as a multiple of pp or None)
SEARCHED = [
    (32, 256, "zb-1p", None),
    (32, 256, "zb-2p", None),
    (32, 256, "zb-v", None),
    (32, 256, "v-half", None),
    (32, 256, "v-min", None),
    (32, 256, "v-auto", 0.5),
    (32, 256, "v-auto", 0.75),
    (32, 256, "v-auto", 1.0),
    (64, 512, "zb-2p", None),
    (64, 512, "zb-v", None),
    (64, 512, "v-auto", 0.5),
    (64, 512, "v-auto", 0.75),
    (64, 512, "v-auto", 1.0),
]


def paper_costs(p: int) -> CostModel:
    return CostModel(p, t_f=18522, t_b=18086, t_w=9337, t_comm=601, mem_f=1, mem_b=-0.55, mem_w=-0.45)


def searched_seconds(name: str, p: int, m: int, limit: float | None, repeat: int) -> tuple[float, float, float]:
    """Best CPU seconds to generate and to validate, and the stage-span bubble."""
    costs = paper_costs(p)
    spec = ScheduleSpec(p, m, costs=costs, memory_limit=limit)
    generate = validate = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        schedule = get(name).generate(spec)
        middle = time.process_time()
        check(schedule, costs)
        generate, validate = min(generate, middle - start), min(validate, time.process_time() - middle)
    return generate, validate, simulate(schedule, costs).bubble_rate


def plan_seconds(name: str, p: int, m: int, repeat: int) -> tuple[float, float]:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        timeline = simulate(build(name, ScheduleSpec(p, m)))
        best = min(best, time.perf_counter() - start)
    return best, timeline.bubble_rate


def searched_table(repeat: int) -> list[str]:
    lines = [
        f"Searched schedules with the paper's profile: CPU seconds (best of {repeat}) to generate, and to validate "
        "as `build` does; stage-span bubble in the last column.",
        "",
        "| pp | m | schedule | generate (s) | validate (s) | total (s) | bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, m, name, factor in SEARCHED:
        limit = None if factor is None else factor * p
        generate, validate, bubble = searched_seconds(name, p, m, limit, repeat)
        label = name if limit is None else f"{name} (limit {limit:g})"
        lines.append(
            f"| {p} | {m} | {label} | {generate:.2f} | {validate:.2f} | {generate + validate:.2f} | {bubble:.2%} |"
        )
        print(lines[-1], flush=True)
    return lines


def handmade_table(repeat: int) -> list[str]:
    lines = [
        f"Handmade generators: plan + validate + simulate, wall seconds (best of {repeat}); stage-span bubble in "
        "brackets.",
        "",
        "| pp | m | " + " | ".join(HANDMADE) + " |",
        "|---|---|" + "---|" * len(HANDMADE),
    ]
    for p, m in SIZES:
        cells = []
        for name in HANDMADE:
            seconds, bubble = plan_seconds(name, p, m, repeat)
            cells.append(f"{seconds:.3f} ({bubble:.1%})")
        lines.append(f"| {p} | {m} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", help="also write the tables to this Markdown file")
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the "
        f"start, Python {platform.python_version()}."
    )
    table = "\n".join([head, "", *searched_table(args.repeat), "", *handmade_table(args.repeat)])
    print()
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            command = f"python scripts/bench_planner.py --output {args.output}"
            handle.write(f"# Planner benchmark\n\nMade by `{command}`.\n\n{table}\n")


if __name__ == "__main__":
    main()
