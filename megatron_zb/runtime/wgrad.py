"""The W queue: weight-gradient work that B leaves behind, run later by the W pass.

B runs autograd as usual, but the weight-gradient GEMMs of split layers (see
``linear_split.py`` and ``te_wgrad.py``) are not computed there: they are queued under the
(chunk, microbatch) whose B is running, and ``run(key)`` computes them when the schedule
reaches that W. Gradients reach the parameters through their own AccumulateGrad nodes, so
DDP's hooks see them exactly as after a plain backward.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

Key = tuple[int, int]  # (model chunk, microbatch)

# Not thread-local: on GPUs autograd runs backward functions (and recomputed forwards) on its
# own device threads. Outside overlapped pairs one executor runs one pass at a time per process.
_active: WeightGradStore | None = None
# A side of an overlapped pair (``own_thread``) keeps its own, so that the two sides entering and
# leaving ``recording`` in either order cannot restore each other's state.
_threads = threading.local()  # .store: this thread's active store, while it has its own


class WeightGradJob(Protocol):
    def run(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Compute the deferred gradients; return (parameter, gradient) pairs still to accumulate."""


class WeightGradStore:
    """Deferred W work of one iteration, keyed by (chunk, microbatch); empty at the end."""

    def __init__(self) -> None:
        self._pending: dict[Key, list[WeightGradJob]] = {}
        self._fifo: dict[int, deque[int]] = {}  # chunk -> microbatches with FIFO-bound (TE) work, in B order
        self._deferring: Key | None = None
        self.alive: weakref.WeakSet = weakref.WeakSet()  # every job not yet run (leak checks in tests)
        self.queued = 0  # jobs queued so far (tests check that B really deferred work)

    # -- B side -------------------------------------------------------------------------------
    @contextmanager
    def recording(self) -> Iterator[None]:
        """Route split layers through their splittable autograd functions (F and B passes)."""
        with _activated(self):
            yield

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave split layers to megatron-core's own function (the F of a microbatch whose backward is a BW)."""
        with _activated(None):
            yield

    @contextmanager
    def deferring(self, key: Key, fifo_jobs: Sequence[WeightGradJob] = ()) -> Iterator[None]:
        """While B of ``key`` runs, split layers queue their weight gradients under ``key``.

        ``fifo_jobs`` are jobs whose layers keep their own FIFO of pending work (Transformer
        Engine's ``backward_dw``): they are queued after the B and must run in B order.
        """
        if self._deferring is not None:
            raise RuntimeError(f"B of chunk {key[0]} mb {key[1]} started inside B of {self._deferring}")
        self._deferring = key
        try:
            with self.recording():
                yield
        finally:
            self._deferring = None
        for job in fifo_jobs:
            self._queue(key, job)
        if fifo_jobs:
            self._fifo.setdefault(key[0], deque()).append(key[1])

    def defer(self, job: WeightGradJob) -> bool:
        """Queue ``job`` under the running B; False when no B is deferring (run it now)."""
        if self._deferring is None:
            return False
        self._queue(self._deferring, job)
        return True

    def _queue(self, key: Key, job: WeightGradJob) -> None:
        self._pending.setdefault(key, []).append(job)
        self.alive.add(job)
        self.queued += 1

    # -- W side -------------------------------------------------------------------------------
    def run(self, key: Key) -> None:
        """Run the W work of ``key`` and accumulate its gradients in one autograd call."""
        chunk, microbatch = key
        order = self._fifo.get(chunk)
        if order and microbatch in order:
            if order[0] != microbatch:
                raise RuntimeError(
                    f"W of chunk {chunk} mb {microbatch} runs before W of mb {order[0]}, but Transformer "
                    f"Engine's backward_dw computes weight gradients in B order; reorder the Ws of chunk {chunk}"
                )
            order.popleft()
        params, grads = [], []
        for job in self._pending.pop(key, ()):
            for param, grad in job.run():
                params.append(param)
                grads.append(grad)
        if params:
            accumulate(params, grads)

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._pending.values())

    def pending_keys(self) -> list[Key]:
        return sorted(self._pending)

    def check_empty(self) -> None:
        if self._pending:
            raise RuntimeError(f"W queue not empty at the end of the iteration: {self.pending_keys()} (chunk, mb)")


def active_store() -> WeightGradStore | None:
    """The store of the pass running now (this thread's, on a side of a pair), or None outside our executor."""
    if hasattr(_threads, "store"):
        return _threads.store
    return _active


@contextmanager
def own_thread() -> Iterator[None]:
    """This thread keeps its own active store (starting from the one active now) for the ``with`` block: each
    side of an overlapped pair, whose ``recording`` must not undo the other side's."""
    if hasattr(_threads, "store"):
        raise RuntimeError("this thread already keeps its own W-queue state (an overlapped pair inside a pair)")
    _threads.store = active_store()
    try:
        yield
    finally:
        del _threads.store


@contextmanager
def _activated(store: WeightGradStore | None) -> Iterator[None]:
    global _active
    if hasattr(_threads, "store"):
        previous, _threads.store = _threads.store, store
        try:
            yield
        finally:
            _threads.store = previous
        return
    previous, _active = _active, store
    try:
        yield
    finally:
        _active = previous


def accumulate(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Add gradients to leaf parameters through their AccumulateGrad nodes (hooks fire as usual)."""
    torch.autograd.backward(params, grads)
