"""A pool of gloo processes that stays up across many test cases.

Importing megatron-core costs seconds per process, so a test module starts one pool and
runs every case in it: ``pool.run(fn, **kwargs)`` calls ``fn(**kwargs)`` on every rank
(``fn`` must be importable, e.g. a module-level function of the test file) and returns the
per-rank results. A case that fails or hangs breaks the pool; the next ``run`` starts a
fresh one, so one bad case cannot stall the rest of the module.

``SharedPools`` keeps one pool per world size for a whole test session (tests/conftest.py):
each module that asks for one gets it reset (``reset_worker``), as if freshly started.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

# A worker holding more threads than this after a case is replaced before the next one. Process
# groups that outlive their case keep their gloo threads, which wake up all the time: megatron-core's
# DDP with overlap_grad_reduce leaves its gradient hooks (and through them the model, its buffers'
# groups) held by autograd nodes that Python's cycle collector cannot see, about 50 threads a case.
# Hundreds of them took half a core per worker and slowed every later case of the session.
MAX_THREADS = 300


class WorkerError(RuntimeError):
    """A case raised on some rank; the message carries every failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, path: list[str], threads: int, inbox, outbox, environment: dict
) -> None:
    os.environ.clear()
    os.environ.update(environment)  # the pool's starter's, not the fork server's (see ``WorkerPool._spawn``)
    sys.path[:] = path
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "Apex is not installed", etc.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from megatron_zb import cpu

    cpu.enable()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException as error:  # e.g. the port was taken between _free_port and rank 0's bind
        outbox.put((rank, False, f"{type(error).__name__}: {error}", 0))
        return
    outbox.put((rank, True, "ready", 0))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, kwargs = job
        try:
            reply = (True, fn(**kwargs))
        except BaseException as error:  # report everything, keep serving
            reply = (False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        # The case's models and runners are garbage now; collect their cycles so that the process
        # groups they held (each with gloo threads that keep waking up) go before the next case.
        gc.collect()
        outbox.put((rank, *reply, len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo processes with megatron-core on CPU (``megatron_zb.cpu.enable()`` applied)."""

    def __init__(self, world_size: int, threads: int = 1, timeout_s: float = 300.0):
        self.world_size, self.threads, self.timeout_s = world_size, threads, timeout_s
        self._procs: list = []

    def _start(self, attempts: int = 3) -> None:
        """Start the ranks and wait until each has joined the group; a start that fails (the free port
        was taken before rank 0 bound it: another process may pick it in between) is retried on a new port."""
        for attempt in range(1, attempts + 1):
            self._spawn()
            try:
                self._wait_until_ready()
                return
            except WorkerError as error:
                self.close()
                if attempt == attempts:
                    raise WorkerError(f"the pool of {self.world_size} ranks did not start: {error}") from error

    def _wait_until_ready(self) -> None:
        import queue
        import time

        ready: set[int] = set()
        deadline = time.monotonic() + self.timeout_s
        while len(ready) < self.world_size:
            try:
                rank, ok, value, _ = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [rank for rank, proc in enumerate(self._procs) if rank not in ready and not proc.is_alive()]
                if dead or time.monotonic() > deadline:
                    waiting = dead or sorted(set(range(self.world_size)) - ready)
                    raise WorkerError(f"ranks {waiting} did not start") from None
                continue
            if not ok:
                raise WorkerError(f"rank {rank} could not join the process group: {value}")
            ready.add(rank)

    def _spawn(self) -> None:
        """The ranks are forks of the launcher's fork server (``training.spawn.RANK_IMPORTS`` imported once):
        a pool replaced after a case that left too many threads starts in a second, not 6 s of imports a rank."""
        from ..training import fork_server
        from ..training.spawn import RANK_IMPORTS

        ctx = mp.get_context("forkserver")
        fork_server.ensure(RANK_IMPORTS)
        port = _free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        shared = (list(sys.path), self.threads)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, *shared, self._inboxes[rank], self._outbox, dict(os.environ)),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable, **kwargs) -> list:
        """``fn(**kwargs)`` on every rank; the results in rank order, or WorkerError."""
        if not self._procs:
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn, kwargs))
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        most_threads = 0
        try:
            for _ in range(self.world_size):
                rank, ok, value, threads = self._outbox.get(timeout=self.timeout_s)
                (results if ok else failures)[rank] = value
                most_threads = max(most_threads, threads)
                if failures and len(results) + len(failures) < self.world_size:
                    # The others may wait forever on the failed rank: collect what arrives soon.
                    self._collect_quickly(results, failures)
                    break
        except Exception as error:  # queue.Empty: a rank hung
            self.close()
            raise WorkerError(f"{fn.__name__}({kwargs}) did not finish within {self.timeout_s:g} s") from error
        if failures:
            self.close()
            first, *others = sorted(failures)
            text = f"--- rank {first} ---\n{failures[first]}" + "".join(
                f"\n--- rank {rank}: {failures[rank].splitlines()[0]}" for rank in others
            )
            raise WorkerError(f"{fn.__name__}({kwargs}) failed on rank(s) {sorted(failures)}:\n{text}")
        if most_threads > MAX_THREADS:
            self.close()  # the next run starts fresh processes
        return [results[rank] for rank in range(self.world_size)]

    def _collect_quickly(self, results: dict, failures: dict, wait_s: float = 5.0) -> None:
        import queue

        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value, _ = self._outbox.get(timeout=wait_s)
            except queue.Empty:
                return
            (results if ok else failures)[rank] = value

    def close(self) -> None:
        for inbox, proc in zip(getattr(self, "_inboxes", []), self._procs, strict=False):
            if proc.is_alive():
                try:
                    inbox.put(None)
                except Exception:
                    pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []


def reset_worker() -> None:
    """Put a pooled worker back to its state after start-up, short of re-importing anything.

    Destroys megatron-core's parallel state and every process group but the default one,
    forgets ``testing.parallel``'s current sizes and puts megatron-core's schedules back.
    """
    from megatron_zb.process_groups import destroy_model_parallel

    destroy_model_parallel()
    parallel = sys.modules.get("megatron_zb.testing.parallel")
    if parallel is not None:
        parallel._current = None
    install = sys.modules.get("megatron_zb.megatron.install")
    if install is not None:
        install.uninstall()
        install._configured.clear()


class SharedPools:
    """One WorkerPool per world size, shared by the modules of a test session."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int, timeout_s: float = 300.0) -> WorkerPool:
        """The pool of ``world_size`` ranks, reset if it already ran cases (it starts on its first ``run``)."""
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = WorkerPool(world_size)
        elif pool._procs:
            pool.run(reset_worker)
        pool.timeout_s = timeout_s
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
