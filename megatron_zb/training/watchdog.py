"""Named timeouts: which rank stalled, and what every other rank was waiting for.

Each rank runs a ``RankWatchdog``: it marks every torch.distributed collective as a wait (the
runtime marks its P2P waits and passes in ``runtime.activity``) and a daemon thread publishes a
small status record every ``interval_s``: the iteration, the pass, what the rank waits for and
since when, where its main thread is, and when it last made progress (started a pass or finished
a wait). With ``--cpu`` the records go to the launcher's store, and ``supervise`` (the launcher)
watches them and the processes: once a rank fails on a timeout, or waits past its timeout, it
prints one report naming the stalled rank (no progress while the others waited) and every
waiting rank, then ends all ranks. Under torchrun there is no common parent: each rank logs its
own record once it waits past the timeout (``publish=None``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch.distributed as dist

from ..runtime.activity import activity
from .collectives import COLLECTIVES, CollectiveWrapper, group_ranks

log = logging.getLogger("megatron_zb.watchdog")

KEY = "megatron_zb/watchdog/{rank}"
GRACE_S = 2.0  # the launcher acts on a wait this long past its timeout if the rank has not failed on it
END_WAIT_S = 3.0  # SIGTERM, then SIGKILL after this long

# megatron-core's groups, by the name its parallel_state getter gives them (first match wins).
GROUP_GETTERS = (
    ("pipeline", "get_pipeline_model_parallel_group"),
    ("tensor-parallel", "get_tensor_model_parallel_group"),
    ("data-parallel", "get_data_parallel_group"),
    ("model-parallel", "get_model_parallel_group"),
    ("tensor-and-data-parallel", "get_tensor_and_data_parallel_group"),
    ("embedding", "get_embedding_group"),
    ("position-embedding", "get_position_embedding_group"),
)


def megatron_group_names() -> dict[int, str]:
    """id(group) -> name for megatron-core's groups this rank belongs to, and the default group."""
    from megatron.core import parallel_state

    names: dict[int, str] = {}
    for name, getter in GROUP_GETTERS:
        try:
            group = getattr(parallel_state, getter)()
        except (AssertionError, AttributeError, RuntimeError, TypeError):  # not built, or not on this rank
            continue
        if group is not None:
            names.setdefault(id(group), name)
    names.setdefault(id(dist.group.WORLD), "default")
    return names


class CollectiveWatch(CollectiveWrapper):
    """Marks every blocking collective as a wait in ``activity``, naming the op and its group."""

    marker = "_collective_watch"

    def __init__(self, timeout_s: float, group_names: dict[int, str]):
        super().__init__(COLLECTIVES)
        self.timeout_s = timeout_s
        self.group_names = group_names

    def _call(self, op: str, original, bound: Callable[[], dict], args: tuple, kwargs: dict):
        arguments = bound()
        if arguments.get("async_op"):  # posted only; its wait() is not seen
            return original(*args, **kwargs)
        group = arguments.get("group")
        ranks = group_ranks(group)
        name = self.group_names.get(id(dist.group.WORLD if group is None else group))
        listed = ", ".join(map(str, ranks))
        what = f"{op} on the {name} group (ranks {listed})" if name else f"{op} on ranks {listed}"
        with activity.waiting(what, self.timeout_s, ranks):
            return original(*args, **kwargs)


class RankWatchdog:
    """Publishes this rank's status every ``interval_s`` (``publish``), or logs it once past the timeout."""

    def __init__(
        self, rank: int, timeout_s: float, publish: Callable[[dict], None] | None = None, interval_s: float = 1.0
    ):
        self.rank, self.timeout_s, self.publish, self.interval_s = rank, timeout_s, publish, interval_s
        self.collectives = CollectiveWatch(timeout_s, megatron_group_names())
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"megatron-zb-watchdog-{rank}", daemon=True)
        self._logged = False
        self._last_wait: dict | None = None  # the latest record taken during a wait

    def start(self) -> None:
        self.collectives.start()
        self._thread.start()

    def stop(self, error: BaseException | None = None) -> None:
        """Stop watching; the last record says whether the rank finished or failed (and on what)."""
        self._stop.set()
        self.collectives.stop()
        if self._thread.is_alive():
            self._thread.join()
        record = self.status()
        record["done"] = error is None
        last, failed = self._last_wait, record["failed"]
        if failed is not None and last is not None and last["wait"]["since"] == failed["since"]:
            # The stack has unwound by now: say where the failed wait was.
            record.update(iteration=last["iteration"], where=last["where"], **{"pass": last["pass"]})
        if error is not None:
            record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if self.publish is None and activity.failed is not None:
                log.error("%s", describe(record, time.time()))
        self._publish(record)

    def status(self) -> dict:
        """This rank's record: plain JSON types, times from ``time.time()``."""
        frame = sys._current_frames().get(self._main)
        wait, failed = activity.wait, activity.failed
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "iteration": _loop_iteration(frame),
            "pass": str(activity.current_pass) if _in_executor(frame) else None,
            "where": _where(frame),
            "progress_time": activity.progress_time,
            "wait": None if wait is None else _wait_record(wait),
            "failed": None if failed is None else {**_wait_record(failed[0]), "error": failed[1]},
        }
        return record

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            record = self.status()
            self._publish(record)
            if record["wait"] is not None:
                self._last_wait = record
            wait = activity.wait
            if self.publish is None and wait is not None and not self._logged:
                if time.time() - wait.since >= wait.timeout_s:
                    log.error("%s", describe(record, time.time()))
                    self._logged = True

    def _publish(self, record: dict) -> None:
        if self.publish is None:
            return
        try:
            self.publish(record)
        except Exception:  # the launcher is gone: nobody left to tell; its end will end this process
            pass


def _wait_record(wait) -> dict:
    return {"what": wait.what, "since": wait.since, "timeout_s": wait.timeout_s, "peers": list(wait.peers)}


def _loop_iteration(frame) -> int | None:
    """The training loop's ``iteration`` on the main thread's stack (None outside the loop)."""
    from . import loop

    code = loop.train.__code__
    while frame is not None:
        if frame.f_code is code:
            value = frame.f_locals.get("iteration")
            return value if isinstance(value, int) else None
        frame = frame.f_back
    return None


def _in_executor(frame) -> bool:
    from ..runtime.executor import Executor

    code = Executor.run.__code__
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


# Our own wrappers and the CPU shims: never where a rank "is".
_SKIPPED = ("/training/watchdog.py", "/runtime/activity.py", "/training/collectives.py", "/megatron_zb/cpu.py")


def _where(frame, depth: int = 4) -> str:
    """The innermost megatron(-core or -zb) frames of the main thread, e.g. ``get_grad_norm_fp32 (...:98) < step``."""
    names = []
    while frame is not None and len(names) < depth:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        package = next((p for p in ("/megatron_zb/", "/megatron/") if p in path), None)
        if package is not None and not path.endswith(_SKIPPED):
            if names:
                names.append(frame.f_code.co_name)
            else:
                short = package[1:] + path.rsplit(package, 1)[1]
                names.append(f"{frame.f_code.co_name} ({short}:{frame.f_lineno})")
        frame = frame.f_back
    return " < ".join(names)


def describe(record: dict, now: float, stalled: bool = False) -> str:
    """One line for one rank: what it was doing, for how long, where."""
    step = []
    if record.get("iteration") is not None:
        step.append(f"iteration {record['iteration']}")
    if record.get("pass"):
        step.append(record["pass"])
    where = f" in {record['where']}" if record.get("where") else ""
    wait = record.get("failed") or record.get("wait")
    if stalled or wait is None:
        state = f"no progress for {now - record['progress_time']:.1f} s" if stalled else "busy"
        if record.get("done"):
            state = "finished"
        text = f"rank {record['rank']}: {'STALLED, ' if stalled else ''}{state}"
    else:
        ended = record["time"] if record.get("failed") else now
        text = (
            f"rank {record['rank']}: waited {ended - wait['since']:.1f} s (timeout {wait['timeout_s']:g} s) "
            f"in {wait['what']}"
        )
    text += f"{', ' if step else ''}{', '.join(step)}{where}"
    if record.get("failed"):
        text += "; " + re.sub(r"\[[^\]]*\] ", "", record["failed"]["error"])  # gloo's "[file.cc:78] "
    return text


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


def stalled_ranks(records: dict[int, dict], world_size: int, now: float) -> list[int]:
    """Ranks that made no progress for at least half the waiters' timeout while not waiting themselves."""
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


def timeout_report(records: dict[int, dict], world_size: int, now: float) -> str:
    """The launcher's report: a headline naming the stalled rank(s), then one line per rank."""
    stalled = stalled_ranks(records, world_size, now)
    waiting = [rank for rank in sorted(records) if is_waiting(records[rank])]
    if stalled:
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
        else:
            lines.append("  " + describe(records[rank], now, stalled=rank in stalled))
    return "\n".join(lines)


# -- the launcher's side ---------------------------------------------------------------------------


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
    """SIGTERM every live process, SIGKILL what is left after END_WAIT_S."""
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
    processes: list, store: dist.Store, failure: Callable[[int], str], received: list[int], poll_s: float = 0.25
) -> int:
    """Wait for the ranks; on a timeout print the report, on a signal or failure end them all. Exit code.

    ``received`` is the list ``caught_signals`` appends SIGINT/SIGTERM to (128 + the signal is returned).
    """
    world_size = len(processes)
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
        records, now = read_records(store, world_size), time.time()
        if any(timed_out(records[r]) for r in failed if r in records) or any(
            overdue(record, now) for record in records.values()
        ):
            print(timeout_report(records, world_size, now), file=sys.stderr)
            end_processes(processes)
            print(f"megatron-zb train: ended all {world_size} ranks", file=sys.stderr)
            return 1
        if failed:
            end_processes(processes)
            print(f"megatron-zb train: {failure(failed[0])}", file=sys.stderr)
            return 1
