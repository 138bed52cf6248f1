"""Iteration time against batch per GPU: every schedule simulated at several microbatch counts.

What breadth-first pipelining is for shows here: with a data-parallel cost (``--cost-dp``) and
ZeRO-3 (``--zero3``), a depth-first order gathers a chunk's weights for every short run of its
passes, a breadth-first one once per group, so at small batch per GPU breadth-first keeps far
more of the ideal throughput. Efficiency is the compute share of the iteration (1 - makespan
bubble): an optimizer step ends every iteration. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .schedule.ir import ScheduleError
from .schedule.lower import DataParallel, lower
from .schedule.registry import ScheduleSpec, build, get, names
from .schedule.simulate import simulate


@dataclass(frozen=True)
class Point:
    name: str
    microbatches: int
    makespan: float
    efficiency: float  # compute / (ranks x makespan)
    peak_memory: float


@dataclass(frozen=True)
class Sweep:
    pp: int
    microbatches: tuple[int, ...]
    points: tuple[Point, ...]
    refused: dict[str, str]  # schedule -> why it ran at none of the microbatch counts
    label: str  # the setting, for titles

    def series(self) -> dict[str, list[Point]]:
        found: dict[str, list[Point]] = {}
        for point in self.points:
            found.setdefault(point.name, []).append(point)
        return found

    def to_text(self) -> str:
        series = self.series()
        width = max((len(name) for name in series), default=8)
        head = "schedule".ljust(width) + "".join(f"  m={m:<7}" for m in self.microbatches)
        lines = [
            f"megatron-zb compare --sweep  {self.label}",
            "efficiency = compute / iteration time (1 - makespan bubble), per microbatch count",
            "",
            head,
        ]
        for name, points in sorted(series.items(), key=lambda item: -item[1][-1].efficiency):
            at = {point.microbatches: point for point in points}
            cells = "".join(f"  {at[m].efficiency:>8.2%}" if m in at else f"  {'-':>8}" for m in self.microbatches)
            lines.append(name.ljust(width) + cells)
        if self.refused:
            lines += ["", "refused:"] + [f"  {name}  {why}" for name, why in sorted(self.refused.items())]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        return {
            "pp": self.pp,
            "microbatches": list(self.microbatches),
            "points": [vars(point) for point in self.points],
            "refused": self.refused,
        }


def sweep(spec: ScheduleSpec, microbatches: list[int], data_parallel: DataParallel | None, label: str) -> Sweep:
    """Every non-composite schedule at each microbatch count (the spec's other fields kept)."""
    points, reasons = [], {}
    for name in names():
        if get(name).composite:
            continue
        for m in microbatches:
            group = spec.breadth_first_microbatches
            try:
                schedule = build(name, replace(spec, microbatches=m, breadth_first_microbatches=group))
                if data_parallel is not None:
                    schedule = lower(schedule, data_parallel)
                timeline = simulate(schedule, spec.cost_model())
            except ScheduleError as error:
                reasons.setdefault(name, str(error).splitlines()[0])
                continue
            efficiency = 1.0 - timeline.bubble_rate_makespan
            points.append(Point(name, m, timeline.makespan, efficiency, max(timeline.peak_memory)))
    ran = {point.name for point in points}
    refused = {name: why for name, why in reasons.items() if name not in ran}
    return Sweep(spec.pp, tuple(microbatches), tuple(points), refused, label)
