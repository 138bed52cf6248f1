"""Run per-rank orders against the dependency rule: the engine under simulator and validator.

Execution model (what the runtime implements): each rank runs its passes in order; a pass
starts when the rank is free and every input has finished (plus the comm latency when the
input was produced on another rank). Sends never block; between two ranks messages are
matched in send order and a receiver posts its receives in that order, so the only way to
deadlock is a cycle of waits, which is reported with the ranks on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .deps import Role, inputs, roles
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
) -> tuple[tuple[Span, ...], ...]:
    """Start/end of every pass, per rank in order; raises DeadlockError if the orders stall.

    ``ready`` is the time each rank becomes free before its first pass (default 0 on every
    rank), e.g. when its optimizer step of the previous iteration ends.
    """
    orders = schedule.orders
    finished: dict[Role, tuple[float, int]] = {}
    waiting: dict[Role, list[int]] = {}
    spans: list[list[Span]] = [[] for _ in orders]
    free = [0.0] * len(orders) if ready is None else [float(t) for t in ready]
    if len(free) != len(orders):
        raise ValueError(f"ready gives {len(free)} times for {len(orders)} ranks")
    runnable = list(range(len(orders)))
    stages = [placement.num_stages for placement in schedule.placements]
    while runnable:
        rank = runnable.pop()
        order = orders[rank]
        while len(spans[rank]) < len(order):
            p = order[len(spans[rank])]
            start, blocked = free[rank], None
            for role in inputs(p, stages[p.pipe]):
                done = finished.get(role)
                if done is None:
                    blocked = role
                    break
                start = max(start, done[0] + (latency if done[1] != rank else 0.0))
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            end = start + duration(p)
            spans[rank].append(Span(start, end))
            free[rank] = end
            for role in roles(p):
                finished[role] = (end, rank)
                runnable.extend(waiting.pop(role, ()))
    if any(len(s) < len(o) for s, o in zip(spans, orders, strict=True)):
        raise _deadlock(schedule, spans, waiting)
    return tuple(tuple(s) for s in spans)


def _deadlock(schedule: Schedule, spans: list[list[Span]], waiting: dict[Role, list[int]]) -> DeadlockError:
    where = producers(schedule)
    waits = {rank: (schedule.orders[rank][len(spans[rank])], role) for role, ranks in waiting.items() for rank in ranks}
    lines = []
    for rank in sorted(waits):
        p, role = waits[rank]
        source = f"rank {where[role][0]}" if role in where else "no rank runs it"
        lines.append(f"  rank {rank} waits at pass {len(spans[rank])} ({p}) for {role} ({source})")
    cycle = _cycle(waits, where)
    if len(cycle) == 2:
        head = f"deadlock: rank {cycle[0]} waits for a pass that comes later in its own order"
    elif cycle:
        head = f"deadlock: ranks {' -> '.join(map(str, cycle))} wait on each other"
    else:
        head = "deadlock: a pass waits for one that no rank runs"
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
