"""Which torch.distributed collectives a rank runs, and when: evidence for a trace.

``CollectiveRecorder`` wraps the collective functions while active and appends one
``CollectiveRecord`` per call: the op, the global ranks of its group and ``perf_counter``
times (the ``PassProfiler``'s clock, so both lie on one axis). It replaces the attributes of
``torch.distributed`` (how megatron-core calls them), of ``torch.distributed.distributed_c10d``
(where one collective calls another: only the outermost call is recorded) and the module-level
aliases megatron-core takes at import (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``),
and puts every one back on ``stop()``: each replacement is recorded in ``megatron_zb.patching``
under the wrapper's own scope, and wrappers stacked on each other (a recorder on the watchdog's) put the
originals back exactly in whichever order they stop.

Times are host times: on a GPU a call returns once the kernel is queued, so a caller that
wants device times synchronises around what it records. An ``async_op=True`` call is recorded
at its post (``end == start`` plus the time to enqueue); its ``wait()`` is not recorded. Not
seen: point-to-point ops (send, recv, batch_isend_irecv), functional collectives
(``torch.distributed._functional_collectives``) and aliases in modules outside ``alias_prefixes``.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import patching
from ..runtime.profiler import PassRecord
from ..schedule.ir import PassKind

# Every collective of torch.distributed; names missing from the installed torch are skipped.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "reduce", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base",
    "_reduce_scatter_base",
)  # fmt: skip
MODULES = (dist, c10d)
_wrapper_ids = itertools.count(1)


@dataclass(frozen=True)
class CollectiveRecord:
    op: str  # the torch.distributed function's name, e.g. "all_reduce"
    ranks: tuple[int, ...]  # global ranks of its group (the default group when called with None)
    start: float  # perf_counter at the call
    end: float  # perf_counter at its return (the post, for async_op=True)
    async_op: bool = False
    iteration: int = 0  # the recorder's ``iteration`` at the call


@dataclass(frozen=True)
class SpanRecord:
    """A named stretch of host time, e.g. the optimizer step (``CollectiveRecorder.span``)."""

    name: str
    start: float
    end: float
    iteration: int = 0


class CollectiveWrapper:
    """Replaces every torch.distributed collective with a wrapper while active; ``stop()`` puts them back.

    Subclasses say what happens around a call in ``_call``; only the outermost collective of a
    thread reaches it (``all_gather_object`` calling ``all_gather`` is one call). Wrappers of
    different subclasses stack (a recorder inside the watchdog); two active ones of one class
    are refused. ``marker`` names the attribute that ties a wrapper function to its owner.

    Each wrapper records its replacements in ``patching`` under a scope of its own
    (``collectives:<class>#<n>``): its lifetime is one run, started and stopped here, which no
    ``megatron_zb.uninstall()`` or ``cpu.disable()`` may cut short; the registry still lists what
    it holds replaced, and puts back what it found.
    """

    marker = "_collective_wrapper"

    def __init__(self, ops: Iterable[str] = COLLECTIVES, alias_prefixes: tuple[str, ...] = ("megatron.",)):
        self.ops = tuple(op for op in ops if hasattr(dist, op))
        self.alias_prefixes = alias_prefixes
        self.scope = f"collectives:{type(self).__name__}#{next(_wrapper_ids)}"
        self._saved: list[patching.Patch] = []  # the registry's entries, while active
        self._local = threading.local()  # call depth per thread: only outermost calls reach _call

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def start(self) -> None:
        if self.active:
            raise RuntimeError(f"this {type(self).__name__} is already active")
        originals = {op: getattr(dist, op) for op in self.ops}
        wrapped = [op for op, fn in originals.items() if getattr(fn, self.marker, None) is not None]
        if wrapped:
            raise RuntimeError(
                f"torch.distributed.{wrapped[0]} is already wrapped by another active {type(self).__name__}"
            )
        wrappers = {id(fn): self._wrap(op, fn) for op, fn in originals.items()}
        for module in (*MODULES, *self._alias_modules()):
            for attribute, value in list(vars(module).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None and value is wrapper.__wrapped__:
                    self._saved.append(patching.replace(module, attribute, wrapper, self.scope))

    def stop(self) -> None:
        """Put back every attribute ``start()`` replaced (a no-op when not active).

        A wrapper started after this one wraps its wrappers: it is stopped first (a recorder left
        running when a run fails stops with the watchdog), so every attribute ends as found.
        """
        saved, self._saved = self._saved, []
        for patch in saved:
            above = getattr(getattr(patch.owner, patch.name, None), "_collective_owner", None)
            if above is not None and above is not self and above.active:
                above.stop()
        patching.undo(self.scope)

    def _alias_modules(self) -> list:
        return [
            module
            for name, module in list(sys.modules.items())
            if module is not None and name.startswith(self.alias_prefixes) and module not in MODULES
        ]

    def _call(self, op: str, original, bound: Callable[[], dict], args: tuple, kwargs: dict):
        """Run ``original(*args, **kwargs)``; ``bound()`` gives the call's arguments by name."""
        raise NotImplementedError

    def _wrap(self, op: str, original):
        signature = inspect.signature(original)
        local = self._local

        def wrapped(*args, **kwargs):
            if getattr(local, "depth", 0) or not self.active:  # nested, or an alias kept past stop()
                return original(*args, **kwargs)
            local.depth = 1
            try:
                return self._call(op, original, lambda: signature.bind(*args, **kwargs).arguments, args, kwargs)
            finally:
                local.depth = 0

        wrapped.__wrapped__ = original
        wrapped.__name__ = wrapped.__qualname__ = op
        wrapped.__doc__ = original.__doc__
        setattr(wrapped, self.marker, self)
        wrapped._collective_owner = self  # whichever subclass: what stop() finds stacked on its own
        return wrapped


class CollectiveRecorder(CollectiveWrapper):
    """Records the collectives this process runs between ``start()`` and ``stop()`` (or inside ``with``).

    One recorder may be active per process. ``iteration`` tags the records, as
    ``PassProfiler.iteration`` tags passes. ``alias_prefixes`` names the packages whose
    module-level aliases of collective functions are wrapped too.
    """

    marker = "_collective_recorder"

    def __init__(self, ops: Iterable[str] = COLLECTIVES, alias_prefixes: tuple[str, ...] = ("megatron.",)):
        super().__init__(ops, alias_prefixes)
        self.iteration = 0
        self.records: list[CollectiveRecord] = []
        self.spans: list[SpanRecord] = []

    def clear(self) -> None:
        self.records.clear()
        self.spans.clear()

    def __enter__(self) -> CollectiveRecorder:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the host time of the ``with`` body as a ``SpanRecord`` (only while recording)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.active:
                self.spans.append(SpanRecord(name, start, time.perf_counter(), self.iteration))

    def _call(self, op: str, original, bound: Callable[[], dict], args: tuple, kwargs: dict):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        end = time.perf_counter()
        arguments = bound()
        ranks = group_ranks(arguments.get("group"))
        self.records.append(CollectiveRecord(op, ranks, start, end, bool(arguments.get("async_op")), self.iteration))
        return result


def group_ranks(group) -> tuple[int, ...]:
    if group is None:
        group = c10d._get_default_group()
    return tuple(dist.get_process_group_ranks(group))


def cross_stage(record: CollectiveRecord, stage_of_rank: dict[int, int]) -> bool:
    """Whether ``record``'s group holds ranks of more than one pipeline stage."""
    missing = [rank for rank in record.ranks if rank not in stage_of_rank]
    if missing:
        raise ValueError(f"{record.op} on ranks {list(record.ranks)}: no pipeline stage given for rank {missing[0]}")
    return len({stage_of_rank[rank] for rank in record.ranks}) > 1


def pipeline_stages(pipeline_group: dist.ProcessGroup) -> dict[int, int]:
    """Global rank -> pipeline stage (rank in its pipeline group) for every rank.

    Collective over the default group (one ``all_gather_object``).
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), pipeline_group.rank()))
    return dict(gathered)


def iteration_gap(passes: Iterable[PassRecord], iteration: int) -> tuple[float, float]:
    """(end of this rank's last pass of ``iteration``, start of its first F of ``iteration + 1``)."""
    passes = list(passes)
    ends = [p.end for p in passes if p.iteration == iteration]
    starts = [p.start for p in passes if p.iteration == iteration + 1 and p.pass_.kind == PassKind.F]
    if not ends:
        raise ValueError(f"no pass of iteration {iteration} among the records")
    if not starts:
        raise ValueError(f"no F pass of iteration {iteration + 1} among the records")
    return max(ends), min(starts)


def collectives_between_iterations(
    passes: Iterable[PassRecord], collectives: Iterable[CollectiveRecord], iteration: int
) -> list[CollectiveRecord]:
    """One rank's collectives that overlap its gap between ``iteration`` and ``iteration + 1``.

    The gap runs from the end of the rank's last pass of ``iteration`` to the start of its first
    F of the next (``iteration_gap``); both lists must come from the same rank and clock. An
    async collective counts where it was posted.
    """
    low, high = iteration_gap(passes, iteration)
    return [c for c in collectives if c.start < high and c.end > low]
