"""Small helpers shared by the generators (one-chunk schedules, the W queue of a rank)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..ir import Pass, Schedule, ScheduleError, W
from ..placement import linear
from ..registry import ScheduleSpec

ONE_CHUNK_HINT = "use interleaved-1f1b for several chunks per rank"


def linear_schedule(name: str, spec: ScheduleSpec, rank_order: Callable[[int, int, int], list[Pass]]) -> Schedule:
    """A one-chunk-per-rank schedule from ``rank_order(rank, pp, microbatches)``."""
    if spec.chunks not in (None, 1):
        raise ScheduleError(f"{name} runs one chunk per rank, got --chunks {spec.chunks}; {ONE_CHUNK_HINT}")
    p, m = spec.pp, spec.microbatches
    return Schedule(name, (linear(p),), m, tuple(tuple(rank_order(rank, p, m)) for rank in range(p)))


class PendingW:
    """Ws a rank has deferred, run oldest first."""

    def __init__(self, stage: int, pipe: int = 0):
        self._stage, self._pipe = stage, pipe
        self._queue: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def defer(self, microbatch: int) -> None:
        self._queue.append(microbatch)

    def pop(self) -> Pass:
        return W(self._stage, self._queue.popleft(), self._pipe)

    def flush(self) -> list[Pass]:
        return [self.pop() for _ in range(len(self._queue))]
