"""Planner of overlapped F&B pairs: which adjacent F and B (or BW) of a rank run as one step.

A pair hides each pass's expert-parallel all-to-all behind the other's compute (``CostModel.pair_time``),
but it is one step: it starts when the inputs of both are done, so a pair can also delay the pass that
did not wait before. ``overlap_pairs`` places pairs greedily, earliest first, keeping one only where the
simulated iteration gets no longer (by ``key``), so the result is never slower than the schedule without
pairs; pairs that only tie are not placed at all. It first tries whole sets: the pairs a generator's order
was written for (``register_seed``: PyTorch's DualPipeV order overlaps its steady state) and every
candidate with its F first (or its backward first), and greedily adds to the best of them. The greedy
times at most ``MAX_TIMINGS`` sets (pp 8, m 32: 0.05 to 0.4 s on a busy machine), fewer where the orders are
long (``MAX_STEPS`` passes timed in all), so that planning time stays bounded at pp 32. The orders are not
changed: only adjacent passes are paired (moving an F next to a backward to make a pair is not tried).
``screened`` times only the whole sets: a quick bound for pickers that rank many schedules paired.

Each candidate is timed by a small simulator of compute orders (``_Timer``): the execution model of
``execute.py`` for compute passes, with pairs as one step, on integer indices. Only stages with
all-to-all time are paired (elsewhere a pair gains nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from .costs import CostModel
from .deps import inputs, roles
from .ir import Pass, PassKind, Schedule, ScheduleError

EPS = 1e-9
MAX_GROUP = 32  # candidates the greedy tries at once, at most
MAX_TIMINGS = 300  # candidate sets one greedy run times, at most
MAX_STEPS = 3_000_000  # ... and at most this many passes timed in all (large settings: fewer sets, bounded time)
KEYS = ("makespan", "stage_span")
Pair = tuple[Pass, Pass]  # (forward, backward)
_SEEDS: list[Callable[[Schedule], Sequence[Pair]]] = []


def register_seed(find: Callable[[Schedule], Sequence[Pair]]) -> None:
    """Add a finder of the pairs a schedule's order was written for (none when the order is not its own)."""
    _SEEDS.append(find)


def overlap_pairs(schedule: Schedule, costs: CostModel, key: str = "makespan") -> Schedule:
    """``schedule`` (compute passes, no pairs) with the overlapped pairs that shorten its iteration.

    ``key``: "makespan", or "stage_span" (first, then makespan) when iterations overlap (post-validation).
    The schedule comes back as it is where pairs do not shorten it, e.g. without all-to-all time, with
    ``costs.overlap`` 0 or less, or where every pair would delay the pass that did not wait (1F1B).
    """
    _check(schedule, costs, key)
    candidates = _candidates(schedule, costs)
    if not candidates:
        return schedule
    timer = _Timer(schedule, costs, key == "stage_span")
    best = timer.key(set())
    chosen: set[int] = set()  # the timer's numbers of the pairs' first passes
    for start in _starting_points(schedule, candidates, timer):
        found = timer.key(start)
        if found is not None and _better(found, best):
            chosen, best = start, found
    for start in (chosen, set()) if chosen else (chosen,):
        found, best_found = _greedy(timer, candidates, start)
        if _better(best_found, best) or not chosen:
            chosen, best = found, best_found
    if not _better(best, timer.key(set())):
        return schedule  # pairs that only tie: a step of two is no gain to run
    by_number = {number: (forward, backward) for forward, backward, number in candidates}
    pairs = tuple(by_number[number] for number in sorted(chosen))
    return replace(schedule, overlapped=pairs) if pairs else schedule


def screened(schedule: Schedule, costs: CostModel, key: str = "makespan") -> tuple[float, float]:
    """A quick bound of what ``overlap_pairs`` reaches: the iteration with the best of its whole sets of pairs
    (or none), each timed once, without the greedy; (makespan, stage span), stage span first with "stage_span".

    ``overlap_pairs`` starts from that set and only keeps what is no longer, so its schedule is never slower.
    A picker ranks its candidates by it and pairs only the best few (``generators/finalists.py``).
    """
    _check(schedule, costs, key)
    timer = _Timer(schedule, costs, key == "stage_span")
    best = timer.key(set())
    candidates = _candidates(schedule, costs)
    for start in _starting_points(schedule, candidates, timer) if candidates else ():
        found = timer.key(start)
        if found is not None and _better(found, best):
            best = found
    return best


def _check(schedule: Schedule, costs: CostModel, key: str) -> None:
    if key not in KEYS:
        raise ScheduleError(f"overlap_pairs key must be one of {', '.join(KEYS)}, got {key!r}")
    if costs.pp != schedule.pp:
        raise ScheduleError(f"cost model is for pp={costs.pp}, schedule {schedule.name} has pp={schedule.pp}")
    if schedule.overlapped:
        raise ScheduleError(f"{schedule.name} already has overlapped pairs; plan them on the schedule without any")
    if any(not p.kind.is_compute for order in schedule.orders for p in order):
        raise ScheduleError(f"{schedule.name} is lowered: plan overlapped pairs before lowering")


def _greedy(timer: _Timer, candidates: list[tuple[Pass, Pass, int]], chosen: set[int]) -> tuple[set[int], tuple]:
    """``chosen`` with the candidates that keep the iteration no longer, earliest first, and its key.

    Runs of candidates are tried together, the run growing while runs are kept and shrinking when one
    is refused (then its candidates are tried one by one): most are kept, or most refused, in a stretch
    of the iteration. At most ``MAX_TIMINGS`` sets are timed; the candidates left after are not paired.
    """
    chosen = set(chosen)
    best = timer.key(chosen)
    starts = timer.starts(chosen)
    queue = [number for _, _, number in sorted(candidates, key=lambda c: (starts[c[2]], c[2]))]
    size, timings, at = 1, 0, 0
    most = max(8, min(MAX_TIMINGS, MAX_STEPS // len(timer.passes)))
    while at < len(queue) and timings < most:
        group: list[int] = []
        while at < len(queue) and len(group) < size:
            number = queue[at]
            at += 1
            if not chosen.union(group).intersection((number - 1, number, number + 1)):
                group.append(number)
        tries = [group] if len(group) == 1 else [group, *([number] for number in group)]
        for trial in tries:
            if timings >= most or chosen.intersection(n + d for n in trial for d in (-1, 0, 1)):
                continue
            timings += 1
            found = timer.key(chosen.union(trial))
            if found is not None and not _better(best, found):  # no longer than the best so far
                chosen.update(trial)
                best = found
                if trial is group:
                    break
        size = min(2 * size, MAX_GROUP) if group and group[0] in chosen else max(1, size // 2)
    return chosen, best


def _starting_points(schedule: Schedule, candidates: list[tuple[Pass, Pass, int]], timer: _Timer) -> list[set[int]]:
    """Whole sets of pairs tried before the greedy: the seeds' pairs, and every candidate with its F first (or
    its B first) left to right. One pair alone can delay the iteration where many together shorten it."""
    seeds = {pair for find in _SEEDS for pair in find(schedule)}
    points = [{number for forward, backward, number in candidates if (forward, backward) in seeds}]
    for forward_first in (True, False):
        matched: set[int] = set()
        for _, _, number in candidates:
            if (timer.passes[number].kind is PassKind.F) == forward_first and number - 1 not in matched:
                matched.add(number)
        points.append(matched)
    return [point for point in points if point]


def _better(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """Whether ``first`` is shorter than ``second`` (beyond EPS), comparing the leading time first."""
    if first[0] < second[0] - EPS:
        return True
    return abs(first[0] - second[0]) <= EPS and first[1] < second[1] - EPS


def _candidates(schedule: Schedule, costs: CostModel) -> list[tuple[Pass, Pass, int]]:
    """(forward, backward, index of the first in the timer's numbering) of adjacent pairs that gain time.

    A pair gains where its time is below the sum of its passes' (all-to-all time on both stages and a
    positive overlap); an F and a backward of one microbatch are left out (the backward needs the forward).
    """
    found = []
    base = 0
    gains: dict[tuple, bool] = {}  # a pair's time depends on its passes' kinds and blocks, not their microbatches
    for order in schedule.orders:
        for index, (first, second) in enumerate(zip(order, order[1:], strict=False)):
            pair = _as_pair(first, second)
            if pair is None or pair[0].microbatch == pair[1].microbatch:
                continue  # a backward needs every forward of its microbatch
            block = tuple((p.kind, p.stage, p.pipe) for p in pair)
            if block not in gains:
                gains[block] = _gains(schedule, costs, *pair)
            if gains[block]:
                found.append((*pair, base + index))
        base += len(order) + 1  # the timer leaves a gap after each rank
    return found


def _as_pair(first: Pass, second: Pass) -> Pair | None:
    backward_kinds = (PassKind.B, PassKind.BW)
    if first.kind is PassKind.F and second.kind in backward_kinds:
        return first, second
    if second.kind is PassKind.F and first.kind in backward_kinds:
        return second, first
    return None


def _gains(schedule: Schedule, costs: CostModel, forward: Pass, backward: Pass) -> bool:
    placements = schedule.placements
    apart = costs.duration(forward, placements[forward.pipe]) + costs.duration(backward, placements[backward.pipe])
    return costs.pair_time(forward, backward, placements) < apart - EPS


class _Timer:
    """The compute orders on integer indices, timed with a chosen set of pairs (see the module).

    Passes are numbered in rank order (all of rank 0's, a gap, rank 1's, ...), so that a candidate
    pair is named by the number of its first pass.
    """

    def __init__(self, schedule: Schedule, costs: CostModel, stage_span_first: bool):
        self.schedule, self.costs, self.stage_span_first = schedule, costs, stage_span_first
        self.passes: list[Pass | None] = []
        self.rank_of: list[int] = []
        self.orders: list[list[int]] = []
        for rank, order in enumerate(schedule.orders):
            self.orders.append(list(range(len(self.passes), len(self.passes) + len(order))))
            self.passes += [*order, None]
            self.rank_of += [rank] * (len(order) + 1)
        producer = {role: n for n, p in enumerate(self.passes) if p is not None for role in roles(p)}
        self.duration = [0.0 if p is None else costs.duration(p, schedule.placements[p.pipe]) for p in self.passes]
        self.inputs: list[list[tuple[int, float]]] = []
        for n, p in enumerate(self.passes):
            needed = [] if p is None else inputs(p, schedule.num_stages(p.pipe))
            self.inputs.append(
                [
                    (producer[role], 0.0 if self.rank_of[producer[role]] == self.rank_of[n] else costs.t_comm)
                    for role in needed
                    if role in producer
                ]
            )
        self.pair_time: dict[int, float] = {}
        self.block_time: dict[tuple, float] = {}

    def _pair_time(self, first: int) -> float:
        if first not in self.pair_time:
            pair = _as_pair(self.passes[first], self.passes[first + 1])
            block = tuple((p.kind, p.stage, p.pipe) for p in pair)  # its time does not depend on the microbatches
            if block not in self.block_time:
                self.block_time[block] = self.costs.pair_time(*pair, self.schedule.placements)
            self.pair_time[first] = self.block_time[block]
        return self.pair_time[first]

    def run(self, chosen: set[int]) -> tuple[list[float], list[float]] | None:
        """Start and end of every pass with the pairs ``chosen`` (by their first's number); None: deadlock."""
        inputs, duration = self.inputs, self.duration
        start = [0.0] * len(self.passes)
        end: list[float | None] = [None] * len(self.passes)
        position = [order[0] if order else 0 for order in self.orders]
        stop = [order[-1] + 1 if order else 0 for order in self.orders]
        free = [0.0] * len(self.orders)
        waiting: dict[int, int] = {}  # pass -> the rank stuck until it ends
        runnable = list(range(len(self.orders)))
        while runnable:
            rank = runnable.pop()
            n, last, at_free = position[rank], stop[rank], free[rank]
            while n < last:
                size = 2 if n in chosen else 1
                at = at_free
                blocked = -1
                for member in range(n, n + size):
                    for source, latency in inputs[member]:
                        done = end[source]
                        if done is None:
                            blocked = source
                            break
                        if done + latency > at:
                            at = done + latency
                    if blocked >= 0:
                        break
                if blocked >= 0:
                    waiting[blocked] = rank
                    break
                at_free = at + (duration[n] if size == 1 else self._pair_time(n))
                for member in range(n, n + size):
                    start[member], end[member] = at, at_free
                    if member in waiting:
                        runnable.append(waiting.pop(member))
                n += size
            position[rank], free[rank] = n, at_free
        if position != stop:
            return None
        return start, [0.0 if e is None else e for e in end]

    def starts(self, chosen: set[int]) -> list[float]:
        timed = self.run(chosen)
        if timed is None:
            raise ScheduleError(f"{self.schedule.name}: the schedule deadlocks with its seeded pairs")
        return timed[0]

    def key(self, chosen: set[int]) -> tuple[float, float] | None:
        """(makespan, stage span), or the other way round; None where the pairs deadlock."""
        timed = self.run(chosen)
        if timed is None:
            return None
        start, end = timed
        spans = [end[order[-1]] - start[order[0]] for order in self.orders if order]
        first = min((start[order[0]] for order in self.orders if order), default=0.0)
        last = max((end[order[-1]] for order in self.orders if order), default=0.0)
        makespan, stage_span = last - first, max(spans, default=0.0)
        return (stage_span, makespan) if self.stage_span_first else (makespan, stage_span)
