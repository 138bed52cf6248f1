"""Named timeouts, the rank's side: what this rank runs and waits for, published on a clock of its own.

Each rank runs a ``RankWatchdog``: it marks every torch.distributed collective and point-to-point wait
as a wait (``CollectiveWatch``, ``P2PWatch``: megatron-core's own schedules included; megatron-zb's runtime
marks its P2P waits and passes in ``runtime.activity`` itself) and a daemon thread publishes a small status
record every ``interval_s``: a heartbeat count, the iteration (megatron-zb's loop or Megatron-LM's), the pass,
what the rank waits for and since when, where its main thread is, and when it last made progress (started
a pass or finished a wait). With ``--cpu`` the records go to the launcher's store, and the launcher
(``supervise``) judges them on its own clock and names the stalled rank. Under torchrun there is no common
parent: each rank logs its own record once it waits past the timeout (``publish=None``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..runtime.activity import activity
from .collectives import COLLECTIVES, CollectiveWrapper, group_ranks

log = logging.getLogger("megatron_zb.watchdog")

HEARTBEAT_S = 0.25  # how often a rank publishes: its last status is that fresh when it stops


def heartbeat_interval(timeout_s: float) -> float:
    """The publishing interval for a run whose waits time out after ``timeout_s``."""
    return min(HEARTBEAT_S, timeout_s / 10)


# torch.distributed's point-to-point functions, which megatron-core's schedules call (names missing are skipped).
P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

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


class P2PWatch(CollectiveWrapper):
    """Marks every point-to-point wait as a wait in ``activity``: blocking send/recv, and ``wait()`` of posted ones.

    megatron-core's schedules post their transfers (``isend``/``irecv``/``batch_isend_irecv``) and wait on
    the returned works later; the works come back wrapped (``WatchedWork``), so that their ``wait()`` is
    seen with the peer it waits for.
    """

    marker = "_p2p_watch"

    def __init__(self, timeout_s: float):
        super().__init__(P2P_OPS)
        self.timeout_s = timeout_s

    def _call(self, op: str, original, bound: Callable[[], dict], args: tuple, kwargs: dict):
        arguments = bound()
        if op == "batch_isend_irecv":
            transfers = arguments.get("p2p_op_list") or []
            works = original(*args, **kwargs)
            peers = tuple(sorted({int(t.peer) for t in transfers}))
            what = f"P2P with ranks {', '.join(map(str, peers))} ({len(transfers)} transfers)"
            return [WatchedWork(work, what, self.timeout_s, peers) for work in works]
        peer = arguments.get("dst", arguments.get("src"))  # a global rank, as megatron-core passes it
        peers = () if peer is None else (int(peer),)
        what = f"{op.removeprefix('i')} {'to' if 'send' in op else 'from'} {f'rank {peer}' if peers else 'any rank'}"
        if op in ("send", "recv"):
            with activity.waiting(what, self.timeout_s, peers):
                return original(*args, **kwargs)
        return WatchedWork(original(*args, **kwargs), what, self.timeout_s, peers)


class WatchedWork:
    """A posted transfer whose ``wait()`` is marked as a wait; everything else is the work's own."""

    def __init__(self, work, what: str, timeout_s: float, peers: tuple[int, ...]):
        self._work, self._what, self._timeout_s, self._peers = work, what, timeout_s, peers

    def wait(self, *args, **kwargs):
        with activity.waiting(self._what, self._timeout_s, self._peers):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class RankWatchdog:
    """Publishes this rank's status every ``interval_s`` (``publish``), or logs it once past the timeout."""

    def __init__(
        self, rank: int, timeout_s: float, publish: Callable[[dict], None] | None = None, interval_s: float = 1.0
    ):
        self.rank, self.timeout_s, self.publish, self.interval_s = rank, timeout_s, publish, interval_s
        self.collectives = CollectiveWatch(timeout_s, megatron_group_names())
        self.transfers = P2PWatch(timeout_s)
        self._beat = 0
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"megatron-zb-watchdog-{rank}", daemon=True)
        self._logged = False
        self._last_wait: dict | None = None  # the latest record taken during a wait

    def start(self) -> None:
        self.collectives.start()
        self.transfers.start()
        self._thread.start()

    def stop(self, error: BaseException | None = None) -> None:
        """Stop watching; the last record says whether the rank finished or failed (and on what). Once only."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.collectives.stop()
        self.transfers.stop()
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
        self._beat += 1
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "beat": self._beat,  # the launcher notes when this moves, on its own clock
            "time": time.time(),
            "timeout_s": self.timeout_s,
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
    """The training loop's ``iteration`` on the main thread's stack: megatron-zb's or Megatron-LM's (else None)."""
    loops = {_code_of("megatron_zb.training.loop"), _code_of("megatron.training.training")}
    while frame is not None:
        if frame.f_code in loops:
            value = frame.f_locals.get("iteration")
            return value if isinstance(value, int) else None
        frame = frame.f_back
    return None


def _code_of(module: str):
    """The code of ``module``'s ``train`` when the module is loaded (it is never imported here)."""
    train = getattr(sys.modules.get(module), "train", None)
    return getattr(train, "__code__", None)


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
