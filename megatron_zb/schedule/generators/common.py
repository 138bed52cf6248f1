"""Small helpers shared by the generators (argument checks, the W queue of a rank)."""

from __future__ import annotations

from collections import deque

from ..ir import Pass, ScheduleError, W
from ..registry import ScheduleSpec


def single_chunk(spec: ScheduleSpec, name: str, hint: str) -> None:
    if spec.chunks not in (None, 1):
        raise ScheduleError(f"{name} runs one chunk per rank, got --chunks {spec.chunks}; {hint}")


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
