"""What this process is doing right now: the pass it runs and what it waits for.

The runtime notes every pass it starts and every wait (a P2P receive, the last sends of an
iteration) here, and ``megatron_zb.training.watchdog`` notes every collective; these are plain
attribute writes, cheap enough for every pass. The watchdog reads them from a background thread,
so that when a rank waits past its timeout the launcher can tell the rank that stopped from the
ranks that wait for it. Nothing here imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Wait:
    """One blocking wait of the main thread."""

    what: str  # e.g. "all_reduce on the pipeline group (ranks 0, 1)"
    since: float  # time.time() at its start
    timeout_s: float  # when the wait itself gives up
    peers: tuple[int, ...] = ()  # global ranks it waits for, where known


class Activity:
    """This process's current pass, current wait and a progress count (passes started, waits done)."""

    def __init__(self) -> None:
        self.progress = 0
        self.progress_time = time.time()
        self.current_pass: object = None  # the Pass the executor runs (or ran last); an overlapped pair's step
        self.wait: Wait | None = None
        self.failed: tuple[Wait, str] | None = None  # a wait that raised, and the error's first line

    def pass_started(self, p: object) -> None:
        self.current_pass = p
        self.progress += 1
        self.progress_time = time.time()

    @contextmanager
    def waiting(self, what: str, timeout_s: float, peers: tuple[int, ...] = ()) -> Iterator[None]:
        """Mark the ``with`` body as a wait; nested waits keep the outermost."""
        if self.wait is not None:
            yield
            return
        self.wait = Wait(what, time.time(), timeout_s, peers)
        try:
            yield
        except BaseException as error:
            self.failed = (self.wait, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            raise
        finally:
            self.wait = None
            self.progress += 1
            self.progress_time = time.time()


activity = Activity()  # one per process: the main thread writes it, the watchdog's thread reads it
