"""Critical-path local search: shorten a planned order by moving passes on its critical path.

Heuristics plan in a model (unit slots, rounds, a list scheduler's myopic choices); the real
costs then leave idle time their model did not see. Time the orders with the real costs and
walk back from the end of the longest rank: each pass started either when its rank finished
the pass before it or when an input arrived (``timing.Clock``'s ``cause``). That chain is the
critical path; nothing off it can shorten the span. Where the path runs through several passes
back to back on one rank (a *run*), reordering that run can let the chain leave the rank
earlier, as in job-shop local search: swap the first two or the last two passes of a run, or
move its first pass to its end or its last to its start; a pass nothing waits for (a W) inside
a run can wait until the run's end. Where the rank waited for an input before a run, a later
pass of the rank that is ready by then and fits in the wait can fill it. A move is kept when
the orders still run (no deadlock), no rank's memory goes over the limit, and the schedule gets
strictly better by stage span, then makespan. First improvement, repeated until no move helps
or the budget of timed candidates is spent: deterministic, no clock. Orders too large for a
useful budget are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..costs import CostModel
from ..placement import Placement
from ..timing import EPS, Clock, Model, run, spans
from .budget import BUDGET
from .result import Result, model_of


def _score(timed: tuple[float, float]) -> tuple[float, float]:
    span, makespan = timed
    return round(span, 9), round(makespan, 9)


def _critical_runs(model: Model, orders: list[list[int]], clock: Clock) -> list[tuple[int, int, int]]:
    """The critical path of the longest rank as runs (rank, first position, last position), earliest first."""
    m = model.encoding.microbatches
    lengths = [clock.free[r] - clock.first[r] if order else -1.0 for r, order in enumerate(orders)]
    r = max(range(len(orders)), key=lambda q: lengths[q])
    made_by = {
        row + x % m: (q, i)
        for q, order in enumerate(orders)
        for i, x in enumerate(order)
        for row in model.writes[x // m]
    }
    runs: list[tuple[int, int, int]] = []
    i = last = len(orders[r]) - 1
    while True:
        cause = clock.cause[orders[r][i]]
        if cause >= 0 or i == 0:  # the run began here: it waited for an input (or is the rank's first pass)
            runs.append((r, i, last))
            if cause < 0:
                break
            r, i = made_by[cause]
            last = i
        else:
            i -= 1
    return runs[::-1]


def _moves(model: Model, orders: list[list[int]], clock: Clock, runs) -> Iterator[tuple[int, int, int]]:
    """(rank, from, to) moves of one pass: job-shop moves inside each run, a pass nothing waits for inside a
    run to its end (weight gradients wait best), then fills of the waits before runs."""
    m = model.encoding.microbatches
    for r, i, j in runs:
        if j > i:
            yield r, i + 1, i
            yield r, j, j - 1
        if j > i + 1:
            yield r, i, j
            yield r, j, i
        for k in range(i + 1, j):
            if not model.awaited[orders[r][k] // m]:
                yield r, k, j
    for r, i, _ in runs:
        if i == 0:
            continue
        order = orders[r]
        gap_start, gap_end = clock.ends(order[i - 1]), clock.start[order[i]]
        if gap_end - gap_start <= EPS:
            continue
        for j in range(i + 1, len(order)):
            x = order[j]
            if model.duration(x) <= gap_end - gap_start + EPS and clock.ready(x) <= gap_start + EPS:
                yield r, j, i


def polish(result: Result, placement: Placement, costs: CostModel, limit: float | None) -> Result:
    """``result`` improved by critical-path moves (itself when no move helps)."""
    tries = min(BUDGET.polish.max_tries, BUDGET.polish.passes // max(1, result.passes))
    if tries < BUDGET.polish.min_tries:
        return result  # too large to search
    model = model_of((placement,), result.microbatches, costs)
    cap = float("inf") if limit is None else limit + EPS
    orders = [list(order) for order in result.codes]
    clock = run(model, orders)
    if clock is None:
        return result
    best = _score(clock.spans())
    improved = True
    while improved and tries > 0:
        improved = False
        seen: set[tuple[int, int, int]] = set()
        for move in _moves(model, orders, clock, _critical_runs(model, orders, clock)):
            if move in seen:
                continue
            seen.add(move)
            r, src, dst = move
            order = orders[r]
            order.insert(dst, order.pop(src))
            if model.peak(order) <= cap:
                tries -= 1
                trial = spans(model, orders)  # most tries fail: the clock is made for the one kept
                if trial is not None and _score(trial) < best:
                    best, clock, improved = _score(trial), run(model, orders), True
                    break
            order.insert(src, order.pop(dst))
            if tries <= 0:
                break
    if best >= _score(spans(model, result.codes)):
        return result
    return Result(orders, result.encoding, best[0], best[1], max(map(model.peak, orders)))
