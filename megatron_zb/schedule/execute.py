"""Run per-rank orders against the dependency rule: the engine under simulator and validator.

Execution model (what the runtime implements): each rank walks its order; a compute pass
starts when the rank's compute stream is free and every input has finished (plus the comm
latency when the input was produced on another rank). A collective (``actions.Stream``) is
issued when the rank reaches it and runs on the rank's data-parallel stream, in order, once its
inputs are done, overlapping the compute passes after it; a host action takes no time. An
all-to-all split out of a compute pass (``ActionSpec.part_of``) holds the compute stream like a
pass, and the pass takes its own time less its parts' (``duration`` gives whole passes). Sends
never block; between two ranks messages are matched in send order and a receiver posts its
receives in that order, so the only way to deadlock is a cycle of waits, which is reported
with the ranks on it. An overlapped pair (``Schedule.overlapped``) is one step: it starts when
the compute stream is free and the inputs of both passes are done, both end together (``paired``
gives the pair's time) and their outputs are sent after it; a pair whose backward needs its
forward, directly or through other ranks, is a deadlock that names the pair.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .actions import Stream, spec
from .deps import Role, inputs, order_inputs, roles, split_parts
from .ir import Pass, Schedule, ScheduleError


class DeadlockError(ScheduleError):
    """The orders cannot all run to the end; ``waits`` maps each stuck rank to its wait."""

    def __init__(self, message: str, waits: dict[int, tuple[Pass, Role]]):
        super().__init__(message)
        self.waits = waits


@dataclass(frozen=True)
class Span:
    start: float
    end: float


def producers(schedule: Schedule) -> dict[Role, tuple[int, Pass]]:
    """Which rank and pass fulfil each role (the last one wins if a schedule repeats a pass)."""
    return {role: (rank, p) for rank, order in enumerate(schedule.orders) for p in order for role in roles(p)}


def execute(
    schedule: Schedule,
    duration: Callable[[Pass], float],
    latency: float = 0.0,
    ready: Sequence[float] | None = None,
    paired: Callable[[Pass, Pass], float] | None = None,
) -> tuple[tuple[Span, ...], ...]:
    """Start/end of every pass, per rank in order; raises DeadlockError if the orders stall.

    ``ready`` is the time each rank becomes free before its first pass (default 0 on every
    rank), e.g. when its optimizer step of the previous iteration ends. ``paired(forward,
    backward)`` is the time of an overlapped pair (default: the two passes' times, no gain);
    both passes of a pair get the pair's span.
    """
    engine = _Engine(schedule, duration, latency, ready, paired)
    while engine.runnable:
        rank = engine.runnable.pop()
        engine.advance(rank)
    stuck = any(len(s) < len(o) or PENDING in s for s, o in zip(engine.spans, schedule.orders, strict=True))
    if stuck:
        raise _deadlock(engine)
    return tuple(tuple(s) for s in engine.spans)


class _Engine:
    """The ranks' clocks and what is done.

    Each rank walks its order on the host: a compute or host action runs once its inputs are
    done; a collective is only issued (the rank goes on) and queued on the rank's collective
    stream, which runs its queue in order, each collective once its inputs are done. A grouped
    collective (REPLICA_SYNC) also waits until every rank of its group has it at the head of
    its stream: the ranks meet at the n-th grouped collective each issues on that group, which
    must be the same one (the same pair of copies), or the orders deadlock.
    """

    def __init__(self, schedule: Schedule, duration, latency: float, ready: Sequence[float] | None, paired=None):
        orders = schedule.orders
        self.paired = paired
        self.pairs = pair_positions(schedule)
        self.schedule, self.duration, self.latency = schedule, duration, latency
        self.finished: dict[Role, tuple[float, int]] = {}
        self.waiting: dict[Role, list[int]] = {}  # role -> ranks whose host or stream head waits for it
        self.spans: list[list[Span]] = [[] for _ in orders]
        self.free = [0.0] * len(orders) if ready is None else [float(t) for t in ready]
        if len(self.free) != len(orders):
            raise ValueError(f"ready gives {len(self.free)} times for {len(orders)} ranks")
        self.collective_free = list(self.free)  # each rank's collective stream
        self.queue: list[deque[tuple[int, float]]] = [deque() for _ in orders]  # (index, issued at) per rank
        self.runnable = list(range(len(orders)))
        self.stages = [placement.num_stages for placement in schedule.placements]
        self.from_order = order_inputs(schedule).inputs
        self.issued: dict[tuple[int, tuple[int, ...]], int] = {}  # (rank, group) -> grouped collectives so far
        self.joining: dict[tuple, dict[int, tuple[float, Pass, int]]] = {}  # (group, n) -> rank -> (ready, p, index)
        self.meeting: dict[tuple[int, int], tuple] = {}  # (rank, index) -> its grouped collective's (group, n)
        self.parts = split_parts(schedule)  # a compute pass's role -> the parts split out of it
        self.part_time: dict[Role, float] = {}  # the durations of those parts, once placed

    def advance(self, rank: int) -> None:
        """Run what can run: the rank's collective stream, then its host, until both wait."""
        order = self.schedule.orders[rank]
        while self._stream(rank) or (len(self.spans[rank]) < len(order) and self._host(rank)):
            pass

    def _ready(self, rank: int, index: int, start: float) -> float | None:
        """When the action's inputs allow it to start (at ``start`` or later); None: one is not done yet."""
        p = self.schedule.orders[rank][index]
        for role in inputs(p, self.stages[p.pipe]) + self.from_order[rank][index]:
            done = self.finished.get(role)
            if done is None:
                self.waiting.setdefault(role, []).append(rank)
                return None
            start = max(start, done[0] + (self.latency if done[1] != rank else 0.0))
        return start

    def _host(self, rank: int) -> bool:
        index = len(self.spans[rank])
        p = self.schedule.orders[rank][index]
        kind = spec(p.kind)
        if kind.stream is Stream.COLLECTIVE:
            if kind.grouped:
                group = group_of(self.schedule, p)
                n = self.issued.get((rank, group), 0)
                self.issued[rank, group] = n + 1
                self.meeting[rank, index] = (group, n)
            self.spans[rank].append(PENDING)
            self.queue[rank].append((index, self.free[rank]))
            return True
        if (rank, index) in self.pairs:
            return self._pair(rank, index)
        start = self._ready(rank, index, self.free[rank])
        if start is None:
            return False
        self._place(rank, index, start)
        return True

    def _pair(self, rank: int, index: int) -> bool:
        """Both passes of an overlapped pair at once, when the inputs of both are done."""
        first, second = self.schedule.orders[rank][index : index + 2]
        forward, backward = self.pairs[rank, index]
        for p, other in ((first, second), (second, first)):
            own = set(inputs(p, self.stages[p.pipe]))
            if own.intersection(roles(other)):
                raise DeadlockError(
                    f"deadlock: overlapped pair ({forward}, {backward}) on rank {rank}: {p} needs {other}, which "
                    "runs in the same step; pair passes that do not depend on each other",
                    {rank: (p, roles(other)[0])},
                )
        start = self._ready(rank, index, self.free[rank])
        start = None if start is None else self._ready(rank, index + 1, start)
        if start is None:
            return False
        if self.paired is not None:
            took = self.paired(forward, backward)
        else:
            took = sum(self._without_parts(p, self.duration(p)) for p in (first, second))
        end = start + took
        self.spans[rank] += [Span(start, end), Span(start, end)]
        self.free[rank] = end
        for p in (first, second):
            for role in roles(p):
                self.finished[role] = (end, rank)
                self.runnable.extend(self.waiting.pop(role, ()))
        return True

    def _stream(self, rank: int) -> bool:
        if not self.queue[rank]:
            return False
        index, issued = self.queue[rank][0]
        start = self._ready(rank, index, max(issued, self.collective_free[rank]))
        if start is None:
            return False
        if (rank, index) not in self.meeting:
            self.queue[rank].popleft()
            self._place(rank, index, start)
            return True
        return self._join(rank, index, start)

    def _join(self, rank: int, index: int, ready: float) -> bool:
        key = self.meeting[rank, index]
        p = self.schedule.orders[rank][index]
        arrived = self.joining.setdefault(key, {})
        if rank in arrived:
            return False  # already at the meeting, waiting for the others
        arrived[rank] = (ready, p, index)
        group, n = key
        if len(arrived) < len(group):
            return False
        if len({_copies(self.schedule, q) for _, q, _ in arrived.values()}) > 1:
            waits = {member: (q, roles(q)[0]) for member, (_, q, _) in arrived.items()}
            raise DeadlockError(_mismatch(group, n, arrived), waits)
        start = max(at for at, _, _ in arrived.values())
        del self.joining[key]
        for member, (_, _, at) in sorted(arrived.items()):
            self.queue[member].popleft()
            self._place(member, at, start)
            if member != rank:
                self.runnable.append(member)
        return True

    def _place(self, rank: int, index: int, start: float) -> None:
        p = self.schedule.orders[rank][index]
        took = self.duration(p)
        if self.parts:
            took = self._without_parts(p, took)
        end = start + took
        if index == len(self.spans[rank]):
            self.spans[rank].append(Span(start, end))
        else:
            self.spans[rank][index] = Span(start, end)
        kind = spec(p.kind)
        if kind.blocks_compute:
            self.free[rank] = end
        elif kind.stream is Stream.COLLECTIVE:
            self.collective_free[rank] = end
        for role in roles(p):
            self.finished[role] = (end, rank)
            self.runnable.extend(self.waiting.pop(role, ()))

    def _without_parts(self, p: Pass, took: float) -> float:
        """A part's time is booked for the pass it is split out of; the pass keeps the rest (never below 0)."""
        if spec(p.kind).part_of:
            for role in roles(p):
                self.part_time[role] = took
            return took
        for role in roles(p):
            for part in self.parts.get(role, ()):
                took -= self.part_time.get(part, 0.0)
        return max(took, 0.0)


PENDING = Span(float("nan"), float("nan"))  # a grouped collective issued before the rest of its group


def pair_positions(schedule: Schedule) -> dict[tuple[int, int], tuple[Pass, Pass]]:
    """(rank, index of a pair's first pass in its order) -> (forward, backward), for every overlapped pair."""
    if not schedule.overlapped:
        return {}
    where = {p: (rank, i) for rank, order in enumerate(schedule.orders) for i, p in enumerate(order)}
    return {min(where[forward], where[backward]): (forward, backward) for forward, backward in schedule.overlapped}


def group_of(schedule: Schedule, p: Pass) -> tuple[int, ...]:
    """The pipeline ranks a grouped collective runs on: the holders of its block and of the block's copy."""
    other = schedule.replica(p.pipe, p.stage)
    ranks = {schedule.rank_of(p)} | ({schedule.placements[other[0]].rank_of(other[1])} if other else set())
    return tuple(sorted(ranks))


def _copies(schedule: Schedule, p: Pass) -> frozenset:
    other = schedule.replica(p.pipe, p.stage)
    return frozenset({(p.pipe, p.stage), *([other] if other else [])})


def _mismatch(group: tuple[int, ...], n: int, arrived: dict[int, tuple[float, Pass, int]]) -> str:
    what = ", ".join(f"rank {rank} {p}" for rank, (_, p, _) in sorted(arrived.items()))
    return (
        f"deadlock: collective #{n} on ranks {list(group)} does not match: {what} (each rank of the group must "
        "issue its replica syncs for the same pairs of copies, in the same order)"
    )


def _deadlock(engine: _Engine) -> DeadlockError:
    """What each stuck rank waits for: its host at its next action, its collective stream at its head."""
    schedule = engine.schedule
    where = producers(schedule)
    blocked: dict[int, set[Role]] = {}
    for role, ranks in engine.waiting.items():
        if role not in engine.finished:
            for rank in ranks:
                blocked.setdefault(rank, set()).add(role)
    waits, lines = {}, []
    stuck_pairs: list[tuple[int, tuple[Pass, Pass]]] = []
    for rank in sorted(blocked):
        order = schedule.orders[rank]
        places = [len(engine.spans[rank])] if len(engine.spans[rank]) < len(order) else []
        if places and (rank, places[0]) in engine.pairs:
            stuck_pairs.append((rank, engine.pairs[rank, places[0]]))
            places.append(places[0] + 1)  # the pair waits for the inputs of both
        places += [index for index, _ in list(engine.queue[rank])[:1]]
        for index in places:
            p = order[index]
            needed = set(inputs(p, engine.stages[p.pipe]) + engine.from_order[rank][index]) & blocked[rank]
            for role in sorted(needed):
                source = f"rank {where[role][0]}" if role in where else "no rank runs it"
                lines.append(f"  rank {rank} waits at pass {index} ({p}) for {role} ({source})")
                waits.setdefault(rank, (p, role))
    cycle = _cycle(waits, where)
    for (group, n), arrived in engine.joining.items():
        for rank, (_, p, index) in sorted(arrived.items()):
            missing = [member for member in group if member not in arrived]
            lines.append(f"  rank {rank} issued {p} (pass {index}); rank(s) {missing} never join collective #{n}")
            waits.setdefault(rank, (p, roles(p)[0]))
    if len(cycle) == 2:
        head = f"deadlock: rank {cycle[0]} waits for a pass that comes later in its own order"
    elif cycle:
        head = f"deadlock: ranks {' -> '.join(map(str, cycle))} wait on each other"
    elif engine.joining:
        head = "deadlock: a collective is never joined by the rest of its group"
    else:
        head = "deadlock: a pass waits for one that no rank runs"
    for rank, (forward, backward) in stuck_pairs:
        head += (
            f"; rank {rank} is at overlapped pair ({forward}, {backward}), one step that waits for the inputs of "
            "both (a pair whose backward needs its forward through other ranks never starts: unpair it)"
        )
    return DeadlockError(head + "\n" + "\n".join(lines), waits)


def _cycle(waits: dict[int, tuple[Pass, Role]], where: dict[Role, tuple[int, Pass]]) -> list[int]:
    for first in sorted(waits):
        path, rank = [], first
        while rank in waits and rank not in path:
            path.append(rank)
            rank = where.get(waits[rank][1], (-1, None))[0]
        if rank in path:
            return path[path.index(rank) :] + [rank]
    return []
