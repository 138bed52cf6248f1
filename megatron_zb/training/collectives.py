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

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..runtime.collective_wrapper import COLLECTIVES, CollectiveWrapper
from ..runtime.profiler import PassRecord
from ..schedule.ir import PassKind


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
