"""Point-to-point transfers between pipeline ranks, with a deadline on every wait.

Receives are posted ahead and waited for right before their consumer; sends never block the
pass that follows them. A send completes only once the peer has posted the matching
receive (gloo and NCCL both rendezvous), so a small thread waits for sends in the
background and drops each sent tensor as soon as its transfer is done; that is what lets a
sent output be freed early, as megatron-core's ``deallocate_output_tensor`` intends.
Consecutive posts go out as one ``batch_isend_irecv`` group on NCCL.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .activity import activity

DEFAULT_TIMEOUT_S = 600.0


class P2PError(RuntimeError):
    """A transfer failed; the message names this rank, the peer, the pass and the microbatch."""


class P2PTimeoutError(P2PError):
    """A transfer did not complete within the timeout."""


@dataclass(frozen=True)
class Transfer:
    """One message as this rank sees it: what it is for, to or from which pipeline rank."""

    peer: int
    what: str  # e.g. "activation for F s2 mb3" or "gradient of B s1 mb0"
    send: bool
    tag: int = 0  # position on its channel: gloo matches by it, so a lost message is named, not its successor

    def describe(self, rank: int) -> str:
        direction = f"sending {self.what} to" if self.send else f"receiving {self.what} from"
        return f"pipeline rank {rank} {direction} pipeline rank {self.peer}"


class PipeComm:
    """Transfers of one rank for one iteration; ``finish()`` waits for the last sends."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.group = group
        self.rank = group.rank()
        self.timeout_s = timeout_s
        self._batch = dist.get_backend(group) == "nccl"
        self._recvs: dict[object, tuple[Transfer, dist.Work, torch.Tensor]] = {}
        self._sender = _SendWaiter(self.rank, timeout_s)
        self.waited_s = 0.0  # time spent waiting for receives (the profiler subtracts it from passes)
        self.posted_s = 0.0  # time spent posting, and in finish() waiting for the last sends (send/recv overhead)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)

    def post(self, recvs: list[tuple[object, Transfer, torch.Tensor]], sends: list[tuple[Transfer, torch.Tensor]]):
        """Post receives (into the given buffers, collected later by key) and sends, in this order."""
        if not recvs and not sends:
            return
        start = time.perf_counter()
        try:
            self._post(recvs, sends)
        finally:
            self.posted_s += time.perf_counter() - start

    def _post(self, recvs: list, sends: list) -> None:
        ops = [dist.P2POp(dist.irecv, buffer, self._global(t.peer), self.group, t.tag) for _, t, buffer in recvs]
        ops += [dist.P2POp(dist.isend, tensor, self._global(t.peer), self.group, t.tag) for t, tensor in sends]
        if not ops:
            return
        try:
            if self._batch and len(ops) > 1:
                works = dist.batch_isend_irecv(ops)
            else:
                works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        except RuntimeError as error:
            first = (recvs[0][1] if recvs else sends[0][0]).describe(self.rank)
            raise P2PError(f"{first}: posting failed: {error}") from error
        for (key, transfer, buffer), work in zip(recvs, works, strict=False):
            self._recvs[key] = (transfer, work, buffer)
        for (transfer, tensor), work in zip(sends, works[len(recvs) :], strict=True):
            self._sender.add(work, tensor, transfer)

    def wait(self, key: object) -> torch.Tensor:
        """The received tensor for ``key``, waiting at most the timeout."""
        transfer, work, buffer = self._recvs.pop(key)
        start = time.perf_counter()
        self._wait_for(work, transfer)
        self.waited_s += time.perf_counter() - start
        self._sender.raise_failure()
        return buffer

    def discard(self, stale: list[tuple[Transfer, torch.Tensor]]) -> None:
        """Receive and drop every posted receive, then the ``stale`` messages (a redone iteration).

        After a rolled-back optimizer step, the messages sent before the check carry results
        of the wrong parameters. Receiving them here, in order, leaves every channel at the
        position where the redone iteration starts sending again.
        """
        posted, self._recvs = self._recvs, {}
        for transfer, work, _ in posted.values():
            self._wait_for(work, transfer)
        for transfer, buffer in stale:
            work = dist.irecv(buffer, self._global(transfer.peer), self.group, transfer.tag)
            self._wait_for(work, transfer)
        self._sender.raise_failure()

    def _wait_for(self, work: dist.Work, transfer: Transfer) -> None:
        description = transfer.describe(self.rank)
        with activity.waiting(description, self.timeout_s, (self._global(transfer.peer),)):
            wait_work(work, self.timeout_s, description)

    def finish(self) -> None:
        """Wait for every send of the iteration; raise if any receive was never collected."""
        start = time.perf_counter()
        with activity.waiting(f"pipeline rank {self.rank} finishing the iteration's sends", self.timeout_s):
            self._sender.close()
        self.posted_s += time.perf_counter() - start
        if self._recvs:
            pending = ", ".join(t.what for t, _, _ in self._recvs.values())
            raise P2PError(f"pipeline rank {self.rank}: receives posted but never used: {pending}")

    def abort(self) -> None:
        self._sender.close(wait=False)


def wait_work(work: dist.Work, timeout_s: float, description: str) -> None:
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:
        waited = time.monotonic() - start
        if "imed out" in str(error) or waited >= timeout_s * 0.99:
            raise P2PTimeoutError(
                f"{description}: timed out after {waited:.1f} s (timeout {timeout_s:g} s); the peer stopped "
                f"sending or runs another schedule"
            ) from error
        raise P2PError(f"{description}: failed after {waited:.1f} s: {error}") from error


class _SendWaiter:
    """Background thread that waits for sends in order and releases their tensors."""

    def __init__(self, rank: int, timeout_s: float):
        self._rank, self._timeout_s = rank, timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._failure: P2PError | None = None
        self._thread = threading.Thread(target=self._loop, name=f"megatron-zb-send-wait-{rank}", daemon=True)
        self._thread.start()

    def add(self, work: dist.Work, tensor: torch.Tensor, transfer: Transfer) -> None:
        self._queue.put((work, tensor, transfer, time.monotonic()))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, tensor, transfer, posted = item  # the tensor stays referenced until its send is done
            if self._failure is None:
                remaining = max(self._timeout_s - (time.monotonic() - posted), 0.001)
                try:
                    wait_work(work, remaining, transfer.describe(self._rank))
                except P2PError as error:
                    self._failure = error
            del work, tensor, item

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def close(self, wait: bool = True) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join()
            self.raise_failure()
