"""The launcher's side of the watchdog: it watches the ranks' heartbeats on its own clock and names the stalled one.

Every rank publishes a status record to the launcher's store four times a second from a thread of its own
(``watchdog.RankWatchdog``): a heartbeat count, what it runs and what it waits for. ``supervise`` reads them
and notes, on its own monotonic clock, when each rank's heartbeat last moved, and asks the OS which ranks'
processes are stopped: a rank stopped by SIGSTOP, or frozen for longer than the timeout, cannot fake that,
however fresh its last record looks. A report is printed once a rank fails on a
timeout, waits past its timeout, falls silent for longer than the timeout, or makes no progress for longer
than the timeout while another rank waits. It names, in order:

1. the rank whose heartbeat went quiet first (stopped, or frozen), with its last published status as
   "last seen";
2. otherwise the ranks whose heartbeat is alive but made no progress (no pass started, no wait ended) while
   the others waited for them (a rank sleeping, or stuck in a computation).

Then one line per rank, and every rank is ended. SIGINT/SIGTERM end all ranks with status 128 + the signal.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import signal
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch.distributed as dist

from .watchdog import describe

KEY = "megatron_zb/watchdog/{rank}"
GRACE_S = 2.0  # the launcher acts on a wait this long past its timeout if the rank has not failed on it
END_WAIT_S = 3.0  # SIGTERM, then SIGKILL after this long
QUIET_S = 2.0  # a stopped process's heartbeat that has not moved for this long (the launcher's clock) has stopped
# What gloo says when a peer stopped or died: never the headline of a report, the launcher's verdict is.
PEER_ERRORS = ("imed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_waiting(record: dict) -> bool:
    return record.get("wait") is not None or record.get("failed") is not None


def timed_out(record: dict) -> bool:
    """Whether this rank failed on a wait that reached its timeout."""
    failed = record.get("failed")
    if failed is None:
        return False
    text = failed["error"]
    return "P2PTimeoutError" in text or "imed out" in text or record["time"] - failed["since"] >= failed["timeout_s"]


def overdue(record: dict, now: float) -> bool:
    wait = record.get("wait")
    return wait is not None and now - wait["since"] > wait["timeout_s"] + GRACE_S


def stuck_too_long(records: dict[int, dict], now: float, limit_s: float) -> bool:
    """Whether a live rank made no progress for ``limit_s`` while another waited half its timeout or more.

    Judged from the stalled rank's last progress, not from when the others began to wait: on a loaded
    machine they may reach their wait seconds after it stopped. The half keeps a rank that is slow to
    start (imports, planning) from being named by a neighbour that has only just begun to wait.
    """
    waits = [record.get("wait") or record.get("failed") for record in records.values() if is_waiting(record)]
    if not any(now - wait["since"] >= 0.5 * wait["timeout_s"] for wait in waits):
        return False
    return any(
        now - record["progress_time"] > limit_s
        for record in records.values()
        if not is_waiting(record) and not record.get("done")
    )


class Heartbeats:
    """When each rank's heartbeat last moved, on the launcher's monotonic clock.

    A heartbeat counts as stopped after ``quiet_s`` when the operating system says the process is stopped
    (SIGSTOP: ``stopped``), and otherwise only after ``frozen_s``: on a loaded machine a live rank's
    publishing thread may wait seconds for a core, and must not be taken for the stalled one.
    """

    def __init__(self, quiet_s: float = QUIET_S, frozen_s: float = QUIET_S):
        self.quiet_s, self.frozen_s = quiet_s, max(quiet_s, frozen_s)
        self._seen: dict[int, tuple[object, float]] = {}

    def update(self, records: dict[int, dict], now: float) -> None:
        for rank, record in records.items():
            beat = record.get("beat", record.get("time"))
            if rank not in self._seen or self._seen[rank][0] != beat:
                self._seen[rank] = (beat, now)

    def quiet(
        self, records: dict[int, dict], now: float, exited: set[int] = frozenset(), stopped: set[int] = frozenset()
    ) -> dict[int, float]:
        """Rank -> when its heartbeat stopped, for the ranks still running (not done, not exited) that went quiet."""
        return {
            rank: since
            for rank, (_, since) in self._seen.items()
            if now - since > (self.quiet_s if rank in stopped else self.frozen_s)
            and rank not in exited
            and not records.get(rank, {}).get("done")
        }


def stopped_processes(processes: list) -> set[int]:
    """The ranks whose process the OS reports stopped (state T: SIGSTOP, a debugger); empty where /proc is absent."""
    found = set()
    for rank, process in enumerate(processes):
        try:
            with open(f"/proc/{process.pid}/stat") as file:
                state = file.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError, TypeError):
            continue
        if state in ("T", "t"):
            found.add(rank)
    return found


def stalled_ranks(
    records: dict[int, dict], world_size: int, now: float, quiet: dict[int, float] | None = None
) -> list[int]:
    """The stalled ranks: those whose heartbeat went quiet, first to go quiet first; else those without progress.

    Without a quiet heartbeat: ranks that made no progress for at least half the waiters' timeout while not
    waiting themselves (a rank that never published counts as stalled).
    """
    if quiet:
        return sorted(quiet, key=lambda rank: (quiet[rank], rank))
    waits = [r.get("failed") or r.get("wait") for r in records.values() if is_waiting(r)]
    if not waits:
        return []
    threshold = 0.5 * min(w["timeout_s"] for w in waits)
    return [
        rank
        for rank in range(world_size)
        if rank not in records
        or (
            not is_waiting(records[rank])
            and not records[rank].get("done")
            and now - records[rank]["progress_time"] >= threshold
        )
    ]


def timeout_report(
    records: dict[int, dict], world_size: int, now: float, quiet: dict[int, float] | None = None, clock: float = 0.0
) -> str:
    """The launcher's report: a headline naming the stalled rank, then one line per rank.

    ``quiet`` maps ranks to when their heartbeat stopped on the launcher's monotonic clock, which reads
    ``clock`` now; ``now`` is wall time, the clock of the records.
    """
    stalled = stalled_ranks(records, world_size, now, quiet)
    waiting = [rank for rank in sorted(records) if is_waiting(records[rank]) and rank not in stalled]
    if stalled and quiet:
        first = stalled[0]
        silent = clock - quiet[first]
        head = (
            f"rank {first} stalled: its heartbeat stopped {silent:.1f} s ago (the launcher's clock: the process is "
            f"stopped or frozen) while {len(waiting)} rank{'s' if len(waiting) != 1 else ''} waited"
        )
        if first in records:
            head += f"; last seen: {_last_seen(records[first])}"
        if len(stalled) > 1:
            head += f"; quiet after it: rank{'s' if len(stalled) > 2 else ''} {', '.join(map(str, stalled[1:]))}"
    elif stalled:
        names = ", ".join(map(str, stalled))
        head = (
            f"rank{'s' if len(stalled) > 1 else ''} {names} stalled: no progress while "
            f"{len(waiting)} rank{'s' if len(waiting) != 1 else ''} waited for {'them' if len(stalled) > 1 else 'it'}"
        )
    else:
        head = (
            "every running rank is waiting: a message or collective call that no rank is going to make "
            "(a lost message, or ranks in different collectives)"
        )
    lines = [f"megatron-zb train: timeout: {head}"]
    for rank in range(world_size):
        if rank not in records:
            lines.append(f"  rank {rank}: STALLED, published no status (never reached training)")
        elif quiet and rank in quiet:
            lines.append(f"  rank {rank}: STALLED, silent for {clock - quiet[rank]:.1f} s; last seen: "
                         f"{_last_seen(records[rank])}")  # fmt: skip
        else:
            lines.append("  " + describe(records[rank], now, stalled=rank in stalled))
    return "\n".join(lines)


def deadline_report(records: dict[int, dict], world_size: int, now: float, deadline_s: float) -> str:
    """The launcher's report when a run outlives its deadline: where each rank was."""
    lines = [f"megatron-zb train: deadline: no result after {deadline_s:.0f} s; each rank's last status:"]
    for rank in range(world_size):
        if rank not in records:
            lines.append(f"  rank {rank}: published no status: still before training (building the model or the data)")
        else:
            lines.append(f"  rank {rank}: {_last_seen(records[rank])}")
    return "\n".join(lines)


def _last_seen(record: dict) -> str:
    """A rank's last published status: what it waited for or ran, the iteration and pass, where."""
    wait = record.get("wait")
    parts = [f"waiting in {wait['what']}" if wait else "running"]
    if record.get("iteration") is not None:
        parts.append(f"iteration {record['iteration']}")
    if record.get("pass"):
        parts.append(record["pass"])
    where = f" in {record['where']}" if record.get("where") else ""
    return ", ".join(parts) + where


# -- the store ------------------------------------------------------------------------------------


def store_publisher(store: dist.Store, rank: int) -> Callable[[dict], None]:
    key = KEY.format(rank=rank)
    return lambda record: store.set(key, json.dumps(record))


def read_records(store: dist.Store, world_size: int) -> dict[int, dict]:
    records = {}
    for rank in range(world_size):
        key = KEY.format(rank=rank)
        if store.check([key]):
            records[rank] = json.loads(store.get(key))
    return records


# -- the processes ---------------------------------------------------------------------------------


@contextmanager
def caught_signals(signals=(signal.SIGINT, signal.SIGTERM)):
    """Record SIGINT/SIGTERM instead of raising; yields the list they are appended to."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def end_processes(processes: list) -> None:
    """SIGTERM every live process, SIGKILL what is left after END_WAIT_S (a stopped process takes only that)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + END_WAIT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def supervise(
    processes: list,
    store: dist.Store,
    failure: Callable[[int], str],
    received: list[int],
    poll_s: float = 0.25,
    timeout_s: float | None = None,
    deadline_s: float | None = None,
) -> int:
    """Wait for the ranks; on a stall print the report, on a signal or failure end them all. Exit code.

    ``received`` is the list ``caught_signals`` appends SIGINT/SIGTERM to (128 + the signal is returned).
    ``timeout_s`` is the runs' wait timeout: a heartbeat silent that long triggers the report even when no
    rank is seen waiting (otherwise the ranks' records say it). ``deadline_s`` bounds the whole run: ranks
    busy without end (a loop that never waits on a peer) are ended then, each named with where it was.
    """
    world_size = len(processes)
    beats = Heartbeats(frozen_s=timeout_s or QUIET_S)  # a live but silent rank counts as frozen after the timeout
    started = time.monotonic()
    while True:
        if received:
            end_processes(processes)
            name = signal.Signals(received[0]).name
            print(f"megatron-zb train: {name} received: ended all {world_size} ranks", file=sys.stderr)
            return 128 + received[0]
        live = [p.sentinel for p in processes if p.exitcode is None]
        if not live and all(p.exitcode == 0 for p in processes):
            return 0
        multiprocessing.connection.wait(live, timeout=poll_s)
        failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
        records, now, clock = read_records(store, world_size), time.time(), time.monotonic()
        beats.update(records, clock)
        exited = {rank for rank, p in enumerate(processes) if p.exitcode is not None}
        quiet = beats.quiet(records, clock, exited, stopped_processes(processes))
        limit = timeout_s if timeout_s is not None else _timeout_of(records)
        silent_too_long = limit is not None and any(clock - since > limit + GRACE_S for since in quiet.values())
        stalled = (
            any(timed_out(records[r]) for r in failed if r in records)
            or any(overdue(record, now) for record in records.values())
            or silent_too_long
            or (limit is not None and stuck_too_long(records, now, limit + GRACE_S))
            or (failed and quiet and any(e in failure(failed[0]) for e in PEER_ERRORS))
        )
        if deadline_s is not None and not failed and clock - started > deadline_s:
            print(deadline_report(records, world_size, now, deadline_s), file=sys.stderr)
            end_processes(processes)
            print(f"megatron-zb train: ended all {world_size} ranks", file=sys.stderr)
            return 1
        if stalled:
            print(timeout_report(records, world_size, now, quiet, clock), file=sys.stderr)
            if failed:
                print(f"megatron-zb train: then {_first_line(failure(failed[0]))}", file=sys.stderr)
            end_processes(processes)
            print(f"megatron-zb train: ended all {world_size} ranks", file=sys.stderr)
            return 1
        if failed:
            end_processes(processes)
            print(f"megatron-zb train: {failure(failed[0])}", file=sys.stderr)
            return 1


def failure_of(context, rank: int) -> str:
    """What rank ``rank`` of a ``torch.multiprocessing`` context died of: its traceback or its exit."""
    import os
    import pickle

    path, code = context.error_files[rank], context.processes[rank].exitcode
    if os.access(path, os.R_OK):
        with open(path, "rb") as file:
            return f"rank {rank} failed:\n{pickle.load(file)}"
    if code < 0:
        return f"rank {rank} was ended by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _timeout_of(records: dict[int, dict]) -> float | None:
    timeouts = [record["timeout_s"] for record in records.values() if record.get("timeout_s")]
    return max(timeouts) if timeouts else None


def _first_line(text: str) -> str:
    """The headline of a rank's failure: its first line and the error's last line, not the traceback."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1].strip()}"
