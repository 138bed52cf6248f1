"""Benchmark (not a test): time to generate + validate + simulate each schedule.

    python scripts/bench_planner.py [--repeat 3] [--output docs/bench_planner.md]

Target: pp=32, m=256 in under 1 s on a 2-core machine. Each cell is the best of --repeat runs.
Covers the handmade generators; the searched ones (zb-auto, V family, auto) are timed by
scripts/bench_schedules.py.
"""

from __future__ import annotations

import argparse
import platform
import time

from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate

SIZES = [(p, m) for p in (8, 32, 64) for m in (4 * p, 8 * p)]
HANDMADE = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"]


def plan_seconds(name: str, p: int, m: int, repeat: int) -> tuple[float, float]:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        timeline = simulate(build(name, ScheduleSpec(p, m)))
        best = min(best, time.perf_counter() - start)
    return best, timeline.bubble_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", help="also write the table to this Markdown file")
    args = parser.parse_args()
    schedules = HANDMADE
    lines = [
        f"Plan + validate + simulate time in seconds (best of {args.repeat}), {platform.processor() or 'cpu'}, "
        f"Python {platform.python_version()}; stage-span bubble in brackets.",
        "",
        "| pp | m | " + " | ".join(schedules) + " |",
        "|---|---|" + "---|" * len(schedules),
    ]
    for p, m in SIZES:
        cells = []
        for name in schedules:
            seconds, bubble = plan_seconds(name, p, m, args.repeat)
            cells.append(f"{seconds:.3f} ({bubble:.1%})")
        lines.append(f"| {p} | {m} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print()
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            command = f"python scripts/bench_planner.py --output {args.output}"
            handle.write(f"# Planner benchmark\n\nMade by `{command}`.\n\n{table}\n")


if __name__ == "__main__":
    main()
