"""Critical-path local search: shorten a planned order by moving passes on its critical path.

Heuristics plan in a model (unit slots, rounds, a list scheduler's myopic choices); the real
costs then leave idle time their model did not see. Time the orders with the real costs and
walk back from the end of the longest rank: each pass started either when its rank finished
the pass before it or when an input arrived. That chain is the critical path; nothing off it
can shorten the span. Where the path runs through several passes back to back on one rank (a
*run*), reordering that run can let the chain leave the rank earlier, as in job-shop local
search: swap the first two or the last two passes of a run, or move its first pass to its end
or its last to its start; a W inside a run can wait until the run's end. Where the rank waited
for an input before a run, a later pass of the rank that is ready by then and fits in the wait
can fill it. A move is kept when the orders
still run (no deadlock), no rank's memory goes over the limit, and the schedule gets strictly
better by stage span, then makespan. First improvement, repeated until no move helps or a budget of
timed candidates is spent: deterministic, no clock. Orders too large for a useful budget are left
as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..costs import CostModel
from ..placement import Placement
from .result import Result

EPS = 1e-9
BUDGET_PASSES = 400_000  # passes timed in all, over the candidates tried (bounds the time taken)
MIN_TRIES, MAX_TRIES = 20, 400  # fewer tries than MIN_TRIES rarely help: then no polish

Timing = tuple[list[float], list[float], list[int]]  # start, end, cause (-1: the rank's previous pass)


class _Model:
    """Durations, memory deltas and inputs of every pass, by its code (result.py's ``encode``)."""

    def __init__(self, placement: Placement, costs: CostModel, m: int):
        n, c = placement.num_stages, placement.chunks
        self.n, self.m = n, m
        self.rank = [placement.rank_of(s) for s in range(n)]
        self.comm = costs.t_comm
        size = 3 * n * m
        self.dur, self.mem = [0.0] * size, [0.0] * size
        self.inputs: list[tuple[int, ...]] = [()] * size
        for s in range(n):
            full = placement.full_stage(s)
            times = (costs.t_f[full] / c, costs.t_b[full] / c, costs.t_w[full] / c)
            deltas = (costs.mem_f[full] / c, costs.mem_b[full] / c, costs.mem_w[full] / c)
            for k in range(m):
                f, b, w = (s * m + k, (n + s) * m + k, (2 * n + s) * m + k)
                for kind, code in enumerate((f, b, w)):
                    self.dur[code], self.mem[code] = times[kind], deltas[kind]
                self.inputs[f] = ((s - 1) * m + k,) if s else ()
                self.inputs[b] = (f,) if s == n - 1 else (f, (n + s + 1) * m + k)
                self.inputs[w] = (b,)
        self.size = size

    def time(self, orders: list[list[int]]) -> Timing | None:
        """As-soon-as-possible times of the orders, and what each pass waited for; None on deadlock."""
        start, end = [0.0] * self.size, [-1.0] * self.size
        cause = [-1] * self.size
        dur, inputs, comm, rank, n, m = self.dur, self.inputs, self.comm, self.rank, self.n, self.m
        at, free = [0] * len(orders), [0.0] * len(orders)
        progress = True
        while progress:
            progress = False
            for r, order in enumerate(orders):
                i, t = at[r], free[r]
                while i < len(order):
                    x = order[i]
                    ready, why = t, -1
                    for y in inputs[x]:
                        done = end[y]
                        if done < 0:
                            break
                        if rank[y // m % n] != r:
                            done += comm
                        if done > ready:
                            ready, why = done, y
                    else:
                        start[x], cause[x] = ready, why
                        t = end[x] = ready + dur[x]
                        i += 1
                        continue
                    break
                if i > at[r]:
                    at[r], free[r], progress = i, t, True
        if any(i < len(order) for i, order in zip(at, orders, strict=True)):
            return None
        return start, end, cause

    def within(self, order: list[int], limit: float) -> bool:
        level = 0.0
        for x in order:
            level += self.mem[x]
            if level > limit:
                return False
        return True


def _score(orders: list[list[int]], timing: Timing) -> tuple[float, float]:
    start, end, _ = timing
    span = max(end[order[-1]] - start[order[0]] for order in orders if order)
    return round(span, 9), round(max(end[o[-1]] for o in orders if o) - min(start[o[0]] for o in orders if o), 9)


def _critical_runs(model: _Model, orders: list[list[int]], timing: Timing) -> list[tuple[int, int, int]]:
    """The critical path of the longest rank as runs (rank, first position, last position), earliest first."""
    start, end, cause = timing
    spans = [end[o[-1]] - start[o[0]] if o else -1.0 for o in orders]
    r = max(range(len(orders)), key=lambda q: spans[q])
    position = {x: i for order in orders for i, x in enumerate(order)}
    runs: list[tuple[int, int, int]] = []
    i = len(orders[r]) - 1
    last = i
    while True:
        x = orders[r][i]
        if cause[x] >= 0 or i == 0:  # the run began here: it waited for an input (or is the rank's first pass)
            runs.append((r, i, last))
            if cause[x] < 0:
                break
            x = cause[x]
            r, i = model.rank[x // model.m % model.n], position[x]
            last = i
        else:
            i -= 1
    return runs[::-1]


def _moves(model: _Model, orders: list[list[int]], timing: Timing, runs) -> Iterator[tuple[int, int, int]]:
    """(rank, from, to) moves of one pass: job-shop moves inside each run, a W inside a run to its end
    (weight gradients wait best), then fills of the waits before runs."""
    weight = 2 * model.n * model.m  # codes from here on are Ws
    for r, i, j in runs:
        if j > i:
            yield r, i + 1, i
            yield r, j, j - 1
        if j > i + 1:
            yield r, i, j
            yield r, j, i
        for k in range(i + 1, j):
            if orders[r][k] >= weight:
                yield r, k, j
    start, end, _ = timing
    for r, i, _ in runs:
        if i == 0:
            continue
        order = orders[r]
        gap_start, gap_end = end[order[i - 1]], start[order[i]]
        if gap_end - gap_start <= EPS:
            continue
        for j in range(i + 1, len(order)):
            x = order[j]
            if model.dur[x] > gap_end - gap_start + EPS:
                continue
            if all(_arrival(model, y, r, end) <= gap_start + EPS for y in model.inputs[x]):
                yield r, j, i


def _arrival(model: _Model, y: int, r: int, end: list[float]) -> float:
    return end[y] + (model.comm if model.rank[y // model.m % model.n] != r else 0.0)


def polish(result: Result, placement: Placement, costs: CostModel, limit: float | None) -> Result:
    """``result`` improved by critical-path moves (itself when no move helps or it has fused BW passes)."""
    m = result.microbatches
    tries = min(MAX_TRIES, BUDGET_PASSES // (3 * result.stages * m))
    if tries < MIN_TRIES or any(code >= 3 * result.stages * m for order in result.codes for code in order):
        return result  # too large to search, or BW passes: nothing to split into the moves
    model = _Model(placement, costs, m)
    cap = float("inf") if limit is None else limit + EPS
    orders = [list(order) for order in result.codes]
    timing = model.time(orders)
    if timing is None:
        return result
    best = _score(orders, timing)
    improved = True
    while improved and tries > 0:
        improved = False
        seen: set[tuple[int, int, int]] = set()
        for move in _moves(model, orders, timing, _critical_runs(model, orders, timing)):
            if move in seen:
                continue
            seen.add(move)
            r, src, dst = move
            order = orders[r]
            order.insert(dst, order.pop(src))
            if model.within(order, cap):
                tries -= 1
                trial = model.time(orders)
                if trial is not None and _score(orders, trial) < best:
                    best, timing, improved = _score(orders, trial), trial, True
                    break
            order.insert(src, order.pop(dst))
            if tries <= 0:
                break
    if best >= _score(result.codes, model.time(result.codes)):
        return result
    return Result(orders, result.stages, m, best[0], best[1], max(_peak(model, order) for order in orders))


def _peak(model: _Model, order: list[int]) -> float:
    level = top = 0.0
    for x in order:
        level += model.mem[x]
        top = max(top, level)
    return top
