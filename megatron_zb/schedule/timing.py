"""The one timing and memory model of per-rank compute orders, on integer codes, for planners.

The simulator (``simulate.py``) times a ``Schedule`` with every kind of action. Planners time
hundreds of candidate orders, and heuristics time each pass as they place it, so they work on
integer codes instead: ``Encoding`` numbers the compute passes of a schedule's placements,
``Model`` states once per (kind, block) what a pass costs, frees and waits for, read from the
IR (``PassKind``, ``actions.spec``, ``deps.inputs``; no kind is named here), and ``Clock`` runs
the execution model of ``execute.py`` for compute passes: a pass starts when its rank is free
and its inputs have ended, plus T_comm across ranks. It records, for every pass, its start and
what it waited for (the input, or its rank), which the critical-path moves walk back. ``run``
times whole orders; the validator runs them with zero costs to find deadlocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from .actions import spec
from .costs import CostModel
from .deps import inputs, roles
from .ir import Pass, PassKind, ScheduleError, made_pass
from .placement import Placement

EPS = 1e-9  # times and memory levels within this are equal
COMPUTE = tuple(kind for kind in PassKind if kind.is_compute)
ROLES = tuple(dict.fromkeys(role for kind in COMPUTE for role in spec(kind).roles))
# roles some compute pass waits for (asked of a block in the middle of three), and the kinds playing none
# of them: nothing waits for such a pass (a W), so it can run later without delaying another
_WAITED = {role.kind for kind in COMPUTE for role in inputs(Pass(kind, 1, 0), 3)}
DEFERRABLE = frozenset(kind for kind in COMPUTE if _WAITED.isdisjoint(spec(kind).roles))


class Encoding:
    """Compute passes as integers: ``(kind * blocks + block) * microbatches + microbatch``.

    ``kind`` indexes ``COMPUTE``; ``block`` numbers the stages of every pipe in turn.
    """

    def __init__(self, placements: Sequence[Placement], microbatches: int):
        self.placements, self.microbatches = tuple(placements), microbatches
        self.where = [(pipe, stage) for pipe, pl in enumerate(self.placements) for stage in range(pl.num_stages)]
        self.base = [sum(pl.num_stages for pl in self.placements[:pipe]) for pipe in range(len(self.placements))]
        self.blocks = len(self.where)
        self.kinds = {kind: index for index, kind in enumerate(COMPUTE)}
        self.size = len(COMPUTE) * self.blocks * microbatches
        self.passes = [
            (kind, stage, pipe) for kind in COMPUTE for pipe, stage in self.where
        ]  # per kind * blocks + block

    def code(self, kind: PassKind, stage: int, microbatch: int, pipe: int = 0) -> int:
        return (self.kinds[kind] * self.blocks + self.base[pipe] + stage) * self.microbatches + microbatch

    def encode(self, p: Pass) -> int:
        return (self.kinds[p.kind] * self.blocks + self.base[p.pipe] + p.stage) * self.microbatches + p.microbatch

    def decode(self, code: int) -> Pass:
        kind_block, microbatch = divmod(code, self.microbatches)
        kind, stage, pipe = self.passes[kind_block]
        return made_pass(kind, stage, microbatch, pipe)


class PassFacts(NamedTuple):
    """What ``Clock.place`` reads of every pass of one (kind, block): one entry of ``Model.passes``."""

    rank: int  # the rank that runs it
    inputs: tuple[tuple[int, bool], ...]  # (role row, crosses ranks) per input it waits for
    writes: tuple[int, ...]  # role rows it fulfils; the first is its own end
    time: float  # duration
    memory: float  # memory it allocates (+) or frees (-)


class Model:
    """What every compute pass costs, frees and waits for, per (kind, block): ``code // microbatches``.

    ``writes`` and ``inputs`` hold role rows: the role of microbatch k is ``row + k``.
    ``costs`` None: every pass takes no time and no memory (the validator's run).
    """

    def __init__(self, encoding: Encoding, costs: CostModel | None = None):
        self.encoding = enc = encoding
        m, n = enc.microbatches, enc.blocks
        self.pp = enc.placements[0].pp
        self.comm = costs.t_comm if costs is not None else 0.0
        self.time, self.memory, self.rank = [], [], []
        self.writes: list[tuple[int, ...]] = []
        self.inputs: list[tuple[tuple[int, bool], ...]] = []
        for kind in COMPUTE:
            for pipe, stage in enc.where:
                placement, p = enc.placements[pipe], Pass(kind, stage, 0, pipe)
                rank = placement.rank_of(stage)
                self.time.append(costs.duration(p, placement) if costs is not None else 0.0)
                self.memory.append(costs.memory_delta(p, placement) if costs is not None else 0.0)
                self.rank.append(rank)
                self.writes.append(tuple(self._row(role) for role in roles(p)))
                needed = inputs(p, placement.num_stages)
                self.inputs.append(tuple((self._row(role), placement.rank_of(role.stage) != rank) for role in needed))
        if not all(math.isfinite(x) for x in (self.comm, *self.time, *self.memory)):
            # CostModel refuses these: a backstop for costs set around it (timed, NaN would order nothing)
            raise ScheduleError(
                "the timing model got a NaN or infinite time or memory: the costs must be finite numbers"
            )
        self.passes = [
            PassFacts(*facts) for facts in zip(self.rank, self.inputs, self.writes, self.time, self.memory, strict=True)
        ]  # per (kind, block)
        self.remote = [any(cross for _, cross in needed) for needed in self.inputs]  # an input crosses ranks
        self.awaited = [kind not in DEFERRABLE for kind in COMPUTE for _ in enc.where]  # some pass waits for it
        self.roles = len(ROLES) * n * m

    def _row(self, role) -> int:
        enc = self.encoding
        return (ROLES.index(role.kind) * enc.blocks + enc.base[role.pipe] + role.stage) * enc.microbatches

    def duration(self, code: int) -> float:
        return self.time[code // self.encoding.microbatches]

    def delta(self, code: int) -> float:
        return self.memory[code // self.encoding.microbatches]

    def peak(self, order: Sequence[int]) -> float:
        """The most memory one rank's order holds (order, not timing, sets it)."""
        memory, m, level, top = self.memory, self.encoding.microbatches, 0.0, 0.0
        for code in order:
            level += memory[code // m]
            top = level if level > top else top
        return top


class Clock:
    """Passes placed as early as their rank and inputs allow, in the order given per rank.

    Per pass: ``start`` and ``cause`` (the role whose arrival set the start, -1 when the rank was
    still busy); per rank: ``first`` start, ``free`` (its last end), ``idle`` time between its
    passes, memory ``level`` and ``peak``, and the ``orders`` placed so far.
    """

    __slots__ = (
        "model", "end", "start", "cause", "free", "first", "idle", "most_idle", "level", "peak",
        "orders", "m", "comm", "passes",
    )  # fmt: skip

    def __init__(self, model: Model):
        self.model = model
        p = model.pp
        self.end = [-1.0] * model.roles  # per role; -1: not done yet
        self.start = [0.0] * model.encoding.size
        self.cause = [-1] * model.encoding.size
        self.free, self.first, self.idle = [0.0] * p, [-1.0] * p, [0.0] * p
        self.most_idle = 0.0  # the largest ``idle`` of any rank
        self.level, self.peak = [0.0] * p, [0.0] * p
        self.orders: list[list[int]] = [[] for _ in range(p)]
        self.m, self.comm, self.passes = model.encoding.microbatches, model.comm, model.passes

    def place(self, code: int) -> bool:
        """Run the pass as early as its rank and inputs allow; False (nothing placed) while an input has not ended."""
        end = self.end
        index, k = divmod(code, self.m)
        facts = self.passes[index]
        r = facts.rank
        t = ready = self.free[r]
        why = -1
        for row, cross in facts.inputs:
            done = end[row + k]
            if done < 0:
                return False
            if cross:
                done += self.comm
            if done > ready:
                ready, why = done, row + k
        if self.first[r] < 0:
            self.first[r] = ready
        elif why >= 0:
            idle = self.idle[r] = self.idle[r] + (ready - t)
            if idle > self.most_idle:
                self.most_idle = idle
        self.start[code], self.cause[code] = ready, why
        t = self.free[r] = ready + facts.time
        for row in facts.writes:
            end[row + k] = t
        level = self.level[r] = self.level[r] + facts.memory
        if level > self.peak[r]:
            self.peak[r] = level
        self.orders[r].append(code)
        return True

    def ready(self, code: int) -> float | None:
        """When the pass's inputs have arrived on its rank; None while one has not ended."""
        index, k = divmod(code, self.m)
        at, end = 0.0, self.end
        for row, cross in self.passes[index].inputs:
            arrival = end[row + k]
            if arrival < 0:
                return None
            arrival += self.comm if cross else 0.0
            at = arrival if arrival > at else at
        return at

    def mark(self, code: int, start: float) -> float:
        """Record that the pass ran from ``start`` (a decision made elsewhere); returns its end."""
        index, k = divmod(code, self.m)
        facts = self.passes[index]
        for row in facts.writes:
            self.end[row + k] = start + facts.time
        return start + facts.time

    def ends(self, code: int) -> float:
        """When a placed pass ends."""
        return self.end[self.passes[code // self.m].writes[0] + code % self.m]

    def spans(self) -> tuple[float, float]:
        """(stage span, makespan) of the passes placed: the longest rank, and first start to last end."""
        busy = [r for r, order in enumerate(self.orders) if order]
        span = max((self.free[r] - self.first[r] for r in busy), default=0.0)
        return span, max(self.free) - min((self.first[r] for r in busy), default=0.0)


def run(model: Model, orders: Sequence[Sequence[int]]) -> Clock | None:
    """Time whole per-rank orders as soon as possible; None if they deadlock.

    ``Clock.place`` inlined (the validator runs every plan through here): the same clock results.
    """
    clock, at = Clock(model), [0] * len(orders)
    m, comm, passes, end, start, cause = clock.m, clock.comm, clock.passes, clock.end, clock.start, clock.cause
    free, first, idle, level, peak, placed = clock.free, clock.first, clock.idle, clock.level, clock.peak, clock.orders
    most_idle, moved, sweep = clock.most_idle, True, list(range(len(orders)))
    while moved:  # a rank runs until a pass waits for an input, in turn until none moves
        moved = False
        for q in sweep:
            order, i = orders[q], at[q]
            n = len(order)
            while i < n:
                code = order[i]
                index, k = divmod(code, m)
                r, needs, writes, time, memory = passes[index]
                t = ready = free[r]
                why = -1
                for row, cross in needs:
                    done = end[row + k]
                    if done < 0:
                        break
                    if cross:
                        done += comm
                    if done > ready:
                        ready, why = done, row + k
                else:
                    if first[r] < 0:
                        first[r] = ready
                    elif why >= 0:
                        waited = idle[r] = idle[r] + (ready - t)
                        if waited > most_idle:
                            most_idle = waited
                    start[code], cause[code] = ready, why
                    t = free[r] = ready + time
                    for row in writes:
                        end[row + k] = t
                    held = level[r] = level[r] + memory
                    if held > peak[r]:
                        peak[r] = held
                    placed[r].append(code)
                    i += 1
                    continue
                break
            if i > at[q]:
                at[q], moved = i, True
        sweep.reverse()  # forward inputs flow down the ranks, backward ones up: sweep both ways
    clock.most_idle = most_idle
    if any(i < len(order) for i, order in zip(at, orders, strict=True)):
        return None
    return clock


def spans(
    model: Model, orders: Sequence[Sequence[int]], start: list[float] | None = None
) -> tuple[float, float] | None:
    """``run(model, orders).spans()`` without the clock: the same sweep and sums, recording only each
    rank's first start and last end (and each pass's start into ``start``, by code, when given).
    Ranking candidates needs no more, and it runs twice as fast; None if the orders deadlock."""
    m, comm, passes, end = model.encoding.microbatches, model.comm, model.passes, [-1.0] * model.roles
    free, first, at = [0.0] * len(orders), [-1.0] * len(orders), [0] * len(orders)
    moved, sweep = True, list(range(len(orders)))
    while moved:
        moved = False
        for r in sweep:
            order, i, t = orders[r], at[r], free[r]
            n = len(order)
            while i < n:
                code = order[i]
                index, k = divmod(code, m)
                _, needs, writes, time, _ = passes[index]  # unpacked: faster than the named fields
                ready = t
                for row, cross in needs:
                    done = end[row + k]
                    if done < 0:
                        break
                    if cross:
                        done += comm
                    if done > ready:
                        ready = done
                else:
                    if first[r] < 0:
                        first[r] = ready
                    if start is not None:
                        start[code] = ready
                    t = ready + time
                    for row in writes:
                        end[row + k] = t
                    i += 1
                    continue
                break
            if i > at[r]:
                at[r], free[r], moved = i, t, True
        sweep.reverse()
    if any(i < len(order) for i, order in zip(at, orders, strict=True)):
        return None
    busy = [r for r, order in enumerate(orders) if order]
    return (
        max((free[r] - first[r] for r in busy), default=0.0),
        max(free) - min((first[r] for r in busy), default=0.0),
    )
