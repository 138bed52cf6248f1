"""Plan a periodic order on few microbatches, then stretch its steady state to all of them.

Building-block orders, ZB-V's rounds and PyTorch's ZB-V order repeat in their steady state:
on every rank, one pass of each kind per chunk, the next microbatch each time. Planning them
for m microbatches costs time in m, yet all that changes with m is how often that period
repeats. So plan for fewer, find on each rank one period followed by the same period one
microbatch later, and insert as many more copies as the missing microbatches after it; every
pass after the copies moves up by that many microbatches. Each kind of pass keeps its
microbatches in order on every rank, and the copies are what a longer steady state would
hold. The caller times (and ``build`` validates) the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..costs import CostModel
from ..ir import ScheduleError
from ..placement import Placement
from .result import Result, timed_codes
from .search import eval_microbatches


def extended(codes: list[list[int]], m: int, period: int, more: int) -> list[list[int]] | None:
    """Encoded orders for m microbatches (timing.Encoding) with ``more`` added to every rank's steady state,
    encoded for m + more; None if a rank has no steady period.

    ``period``: passes of one microbatch on a rank (3 per chunk, F, B and W).
    """
    out = []
    longer = m + more
    for order in codes:
        at = _steady(order, m, period)
        if at is None:
            return None
        cut = at + period
        recoded = [code // m * longer + code % m for code in order]
        copies = [code + k for k in range(1, more + 1) for code in recoded[at:cut]]
        out.append(recoded[:cut] + copies + [code + more for code in recoded[cut:]])
    return out


def _steady(order: list[int], m: int, period: int) -> int | None:
    """Where a period starts that the next period repeats one microbatch later: the middle of the
    longest stretch of such periods (away from the warm-up and the cool-down)."""
    # repeats[i]: the pass a period after i is i's pass (kind and stage) for the next microbatch
    repeats = [y == x + 1 and y % m != 0 for x, y in zip(order, order[period:], strict=False)]
    best, start = (0, 0), 0
    for i, ok in enumerate([*repeats, False]):
        if not ok:
            best, start = max(best, (i - start, start)), i + 1
    length, first = best
    return None if length < period else first + (length - period) // 2


def fewer_microbatches(m: int, placement: Placement) -> int:
    """How many microbatches to plan before stretching: m where that is cheap (``eval_microbatches``),
    else enough for a steady state between the warm-up and the cool-down (3pp; with 2pp the squeezed
    blocks' two phases still touch)."""
    fewer = eval_microbatches(m, placement)
    return m if fewer >= m else min(m, max(fewer, 3 * placement.pp))


def stretched(
    plan: Callable[[int], Result | Sequence[Sequence[int]]], placement: Placement, costs: CostModel, m: int
) -> Result | None:
    """``plan``'s result for m microbatches (encoded orders are timed; None if they deadlock): planned
    for fewer and extended on large settings (``fewer_microbatches``), or planned for all where that is
    cheap or the fewer do not stretch (refused, no steady period, or the longer orders deadlock)."""
    fewer = fewer_microbatches(m, placement)
    if fewer < m:
        try:
            planned = plan(fewer)
            codes = planned.codes if isinstance(planned, Result) else planned
            longer = extended(codes, fewer, 3 * placement.chunks, m - fewer)
        except ScheduleError:
            longer = None  # a plan that cannot run fewer may still run all of them
        result = None if longer is None else timed_codes(longer, placement, costs, m)
        if result is not None:
            return result
    full = plan(m)
    return full if isinstance(full, Result) else timed_codes(full, placement, costs, m)
