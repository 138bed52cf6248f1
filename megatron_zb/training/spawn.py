"""How the ``--cpu`` ranks start: forks of a fork server, each taking its launcher's environment and outputs.

Used by megatron-zb's own launcher (``pretrain_gpt``), Megatron-LM's (``megatron_lm.launch``), verify and the tests'
rank pools alike.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RANK_IMPORTS = ("megatron_zb.training.rank_imports",)


def start_ranks(worker: Callable, args: tuple, processes: int, modules: Sequence[str] = RANK_IMPORTS):
    """``processes`` forks of a server that imported ``modules`` once (training/rank_imports.py), each running
    ``worker(rank, launcher, *args)``: a torch ``ProcessContext``. A fork server keeps the environment and
    the stdout/stderr it started with; ``launcher`` (``Launcher``) holds this process's as they are now,
    and the worker applies it first (``Launcher.apply``). The server imports from this process's ``sys.path``
    (``training.fork_server``)."""
    import torch.multiprocessing as mp

    from . import fork_server

    fork_server.ensure(modules)
    return mp.start_processes(
        worker, args=(Launcher.now(), *args), nprocs=processes, join=False, start_method="forkserver"
    )


@dataclass(frozen=True)
class Launcher:
    """What a rank takes from the process that started it: its environment, and where its stdout and stderr go."""

    environment: dict[str, str]
    pid: int
    outputs: tuple[tuple[int, int] | None, ...]  # (device, inode) of file descriptors 1 and 2

    @classmethod
    def now(cls) -> Launcher:
        return cls(dict(os.environ), os.getpid(), tuple(_identity(fd) for fd in (1, 2)))

    def apply(self) -> None:
        """This process's environment, stdout and stderr as the launcher's (e.g. verify's log of a run)."""
        os.environ.clear()
        os.environ.update(self.environment)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, launchers in zip((1, 2), self.outputs, strict=True):
            if launchers is None or _identity(fd) == launchers:
                continue
            try:  # the same file, pipe or terminal, reopened through the launcher (Linux /proc)
                target = os.open(f"/proc/{self.pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
            except OSError:
                continue  # unreachable (no /proc, a socket): the rank writes where its fork server does
            os.dup2(target, fd)
            os.close(target)


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        found = os.fstat(fd)
    except OSError:
        return None
    return found.st_dev, found.st_ino
