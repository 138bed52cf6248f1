"""Small helpers shared by the generators (one-chunk schedules)."""

from __future__ import annotations

from collections.abc import Callable

from ..ir import Pass, Schedule, ScheduleError
from ..placement import linear
from ..registry import ScheduleSpec

ONE_CHUNK_HINT = "use interleaved-1f1b for several chunks per rank"


def linear_schedule(name: str, spec: ScheduleSpec, rank_order: Callable[[int, int, int], list[Pass]]) -> Schedule:
    """A one-chunk-per-rank schedule from ``rank_order(rank, pp, microbatches)``."""
    if spec.chunks not in (None, 1):
        raise ScheduleError(f"{name} runs one chunk per rank, got --chunks {spec.chunks}; {ONE_CHUNK_HINT}")
    p, m = spec.pp, spec.microbatches
    return Schedule(name, (linear(p),), m, tuple(tuple(rank_order(rank, p, m)) for rank in range(p)))
