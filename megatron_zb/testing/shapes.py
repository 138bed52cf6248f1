"""Schedules grouped by shape: what the runtime's work with megatron-core depends on.

The order of the passes is the schedule core's business and no megatron-core version changes
it; how they meet megatron-core (which model chunks, fused or split backwards, one pipe or two)
does. Tests that run every schedule use ``one_per_shape`` where one of each shape is enough.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..schedule.ir import ScheduleError
from ..schedule.registry import ScheduleSpec, build

PP, MICROBATCHES = 2, 5  # pp=2 with an odd m: every family but BitPipe runs it


def shape(name: str, pp: int = PP, microbatches: int = MICROBATCHES) -> tuple | None:
    """Placements, chunks per rank and pass kinds of ``name`` at pp/microbatches; None if it refuses them."""
    try:
        schedule = build(name, ScheduleSpec(pp, microbatches))
    except ScheduleError:
        return None
    kinds = frozenset(p.kind for order in schedule.orders for p in order)
    return tuple(placement.kind for placement in schedule.placements), schedule.chunks, kinds


def one_per_shape(names: Iterable[str], pp: int = PP, microbatches: int = MICROBATCHES) -> list[str]:
    """The first name of each shape, in the order given (names that refuse the setting are left out)."""
    found: dict[tuple, str] = {}
    for name in names:
        key = shape(name, pp, microbatches)
        if key is not None:
            found.setdefault(key, name)
    return list(found.values())
