"""What the training log reports from measured passes: bubble rate, a Perfetto trace, metrics lines.

``PassProfiler`` records each compute pass's ``perf_counter`` start and end (time spent waiting
for its inputs excluded). The bubble of one ``forward_backward`` call on one rank is the part
of its wall time in which no pass ran; the pipeline's is the mean (and the worst) over its
ranks. The trace puts one iteration's passes of every pipeline rank on one time axis, named
as in the simulated trace, so the two open side by side in ui.perfetto.dev. It can also hold
several iterations and, from a ``CollectiveRecorder``, the collectives each rank ran (marked
when they span pipeline stages) and named spans such as the optimizer step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..process_groups import group_device
from ..render.chrome_trace import PID, collective_track, metadata_events, pass_event
from ..runtime.profiler import PassRecord
from ..schedule.simulate import PassTime
from .collectives import CollectiveRecord, CollectiveRecorder, SpanRecord, cross_stage, pipeline_stages

SECONDS_TO_US = 1e6


def measured_bubble(records: list[PassRecord], iteration: int, wall_start: float, wall_end: float) -> float:
    """1 - (sum of this rank's pass durations in ``iteration``) / (wall time of its forward_backward call).

    ``wall_start``/``wall_end`` are ``perf_counter`` readings around the call (on a GPU, taken
    after a device synchronize, as the profiler's own times are).
    """
    wall = wall_end - wall_start
    if wall <= 0:
        raise ValueError(
            f"wall_end ({wall_end}) must be after wall_start ({wall_start}): time the forward_backward call"
        )
    busy = sum(r.end - r.start for r in records if r.iteration == iteration and r.pass_.kind.is_compute)
    return 1.0 - busy / wall


@dataclass(frozen=True)
class PipelineBubble:
    mean: float  # what the log reports: comparable to the simulator's bubble rate
    max: float  # the worst rank
    per_rank: tuple[float, ...]  # in pipeline rank order


def pipeline_bubble(
    records: list[PassRecord],
    iteration: int,
    wall_start: float,
    wall_end: float,
    group: dist.ProcessGroup | None = None,
) -> PipelineBubble:
    """Every pipeline rank's ``measured_bubble``, the same on all of them (one all-gather over ``group``).

    Collective over ``group``, megatron-core's pipeline group when None.
    """
    local = measured_bubble(records, iteration, wall_start, wall_end)
    if not dist.is_initialized():
        return PipelineBubble(local, local, (local,))
    group = _pipeline_group() if group is None else group
    device = group_device(group)
    mine = torch.tensor([local], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    per_rank = tuple(float(t.item()) for t in gathered)
    return PipelineBubble(sum(per_rank) / len(per_rank), max(per_rank), per_rank)


def pipeline_bubbles(local: list[float | None], group: dist.ProcessGroup | None = None) -> list[float | None]:
    """Per iteration, the mean over pipeline ranks of ``measured_bubble`` (one all-gather over ``group``).

    ``local`` holds this rank's bubbles of a few iterations (None where not measured), the same
    iterations on every rank; collective over ``group``, megatron-core's pipeline group when None.
    """
    if not dist.is_initialized():
        return list(local)
    group = _pipeline_group() if group is None else group
    values = [float("nan") if v is None else v for v in local]
    mine = torch.tensor(values, dtype=torch.float64, device=group_device(group))
    gathered = [torch.zeros_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    means = torch.stack(gathered).mean(dim=0)
    return [None if value is None else float(mean) for value, mean in zip(local, means, strict=True)]


def gather_records(
    records: list[PassRecord], iteration: int, group: dist.ProcessGroup | None = None
) -> list[list[PassRecord]] | None:
    """This iteration's records of every rank of ``group``, on its first rank (None elsewhere).

    Collective over ``group`` (megatron-core's pipeline group when None; the first pipeline's
    first rank is global rank 0). Each rank's times are made relative to its exit from a
    barrier taken here, which all ranks leave together (to within the barrier's latency): that
    aligns ranks whose clocks differ, e.g. on several nodes. Only relative times matter to
    ``write_measured_trace``.
    """
    group = _pipeline_group() if group is None else group
    gathered = _gather_shifted(([r for r in records if r.iteration == iteration],), group)
    return None if gathered is None else [lists[0] for lists in gathered]


@dataclass(frozen=True)
class GatheredTrace:
    """Every pipeline rank's records for ``write_measured_trace``, times relative to one barrier exit."""

    passes: list[list[PassRecord]]  # per pipeline rank
    collectives: list[list[CollectiveRecord]]  # per pipeline rank
    spans: list[list[SpanRecord]]  # per pipeline rank
    stage_of_rank: dict[int, int]  # global rank -> pipeline stage, every rank of the job


def gather_trace(
    records: list[PassRecord],
    iterations: Iterable[int],
    recorder: CollectiveRecorder | None = None,
    group: dist.ProcessGroup | None = None,
) -> GatheredTrace | None:
    """``gather_records`` for several iterations, with the recorder's collectives and spans.

    On the first rank of ``group`` (None elsewhere). Collective over the default group (the
    stage of every rank, for ``cross_stage``) and over ``group`` (megatron-core's pipeline group
    when None). Records are picked by their ``iteration`` tag, so set ``recorder.iteration`` as
    ``PassProfiler.iteration``. Stop the recorder first: the collectives taken here are not
    part of any iteration (they are left out either way).
    """
    wanted = set(iterations)
    collectives = list(recorder.records) if recorder is not None else []
    spans = list(recorder.spans) if recorder is not None else []
    group = _pipeline_group() if group is None else group
    stage_of_rank = pipeline_stages(group)
    mine = (
        [r for r in records if r.iteration in wanted],
        [c for c in collectives if c.iteration in wanted],
        [s for s in spans if s.iteration in wanted],
    )
    gathered = _gather_shifted(mine, group)
    if gathered is None:
        return None
    passes, collectives, spans = (list(column) for column in zip(*gathered, strict=True))
    return GatheredTrace(passes, collectives, spans, stage_of_rank)


def _gather_shifted(lists: tuple[list, ...], group: dist.ProcessGroup) -> list[tuple[list, ...]] | None:
    """Every rank's ``lists`` of timed records (``start``/``end`` fields), on the first rank of ``group``.

    Times are shifted to each rank's exit from a barrier taken here (see ``gather_records``).
    """
    dist.barrier(group=group)
    reference = time.perf_counter()
    shifted = tuple([replace(r, start=r.start - reference, end=r.end - reference) for r in items] for items in lists)
    gathered: list | None = [None] * group.size() if group.rank() == 0 else None
    dist.gather_object(shifted, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return gathered


def write_measured_trace(
    path: str | Path,
    records_per_rank: list[list[PassRecord]],
    schedule_name: str,
    iteration: int | Iterable[int] | None = None,
    extra: dict | None = None,
    *,
    collectives_per_rank: list[list[CollectiveRecord]] | None = None,
    spans_per_rank: list[list[SpanRecord]] | None = None,
    stage_of_rank: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Write a Chrome/Perfetto trace of measured passes; returns the trace object.

    ``records_per_rank[r]`` are pipeline rank r's records (``gather_records`` output, or raw
    ``perf_counter`` times from one machine). ``iteration`` picks one iteration, or several
    (e.g. ``(i, i + 1)``: the passes then carry their iteration in ``args``), when the records
    hold more. Times start at the earliest event of any rank; one track per pipeline rank.
    ``extra`` (wall times, loss, ...) goes into the trace's ``otherData``.

    ``collectives_per_rank`` (``GatheredTrace.collectives``, on the same clock) adds one event
    per collective on its rank's track, category "collective", named by the op, with the
    group's global ranks and whether it spans stages (``stage_of_rank`` then required);
    ``spans_per_rank`` adds the named spans (category "span"), e.g. the optimizer step. Both
    are picked by their iteration tag as the passes are.
    """
    chosen, iterations = _choose(records_per_rank, iteration)
    collectives = [[c for c in rank if c.iteration in iterations] for rank in collectives_per_rank or []]
    spans = [[s for s in rank if s.iteration in iterations] for rank in spans_per_rank or []]
    if any(collectives) and stage_of_rank is None:
        raise ValueError("collectives in a trace need stage_of_rank (GatheredTrace.stage_of_rank) to mark cross_stage")
    start = min([r.start for rank in chosen for r in rank] + [e.start for rank in collectives + spans for e in rank])
    ordered = [sorted(rank, key=lambda r: r.start) for rank in chosen]
    ranks = [
        [PassTime(r.pass_, index, r.chunk, r.start - start, r.end - start) for r in rank]
        for index, rank in enumerate(ordered)
    ]
    events = [pass_event(t, SECONDS_TO_US) for rank in ranks for t in rank]
    if len(iterations) > 1:  # tell the iterations' passes apart
        for event, r in zip(events, [r for rank in ordered for r in rank], strict=True):
            event["args"]["iteration"] = r.iteration
    for index, rank in enumerate(collectives):
        events += [_collective_event(c, index, start, stage_of_rank) for c in rank]
    for index, rank in enumerate(spans):
        events += [
            _timed_event(s.name, "span", index, s.start - start, s.end - start, {"iteration": s.iteration})
            for s in rank
        ]
    span = f"iteration {iterations[0]}" if len(iterations) == 1 else f"iterations {iterations[0]}-{iterations[-1]}"
    header = metadata_events(f"{schedule_name} measured {span}", len(ranks))
    header += [event for index, rank in enumerate(ranks) if any(not t.pass_.kind.is_compute for t in rank)
               for event in collective_track(index)]  # fmt: skip
    other = {**_summary(ranks), "schedule": schedule_name, "iterations": iterations}
    if len(iterations) == 1:
        other["iteration"] = iterations[0]
    trace = {"traceEvents": header + events, "displayTimeUnit": "ms", "otherData": {**other, **(extra or {})}}
    Path(path).write_text(json.dumps(trace))
    return trace


def _choose(records_per_rank: list[list[PassRecord]], iteration) -> tuple[list[list[PassRecord]], list[int]]:
    """The records of the wanted iteration(s), and those iterations sorted; errors name what the records hold."""
    wanted = None if iteration is None else {iteration} if isinstance(iteration, int) else set(iteration)
    chosen = [[r for r in rank if wanted is None or r.iteration in wanted] for rank in records_per_rank]
    iterations = sorted({r.iteration for rank in chosen for r in rank})
    held = sorted({r.iteration for rank in records_per_rank for r in rank})
    found = ", ".join(map(str, iterations)) or "none"
    if (wanted is None or len(wanted) == 1) and len(iterations) != 1:
        raise ValueError(f"a measured trace shows one iteration; records hold iteration(s) {found}: pass iteration=")
    if wanted is not None and set(iterations) != wanted:
        missing = ", ".join(map(str, sorted(wanted - set(iterations))))
        raise ValueError(
            f"no records of iteration(s) {missing}; records hold iteration(s) {', '.join(map(str, held)) or 'none'}"
        )
    return chosen, iterations


def _collective_event(c: CollectiveRecord, rank: int, origin: float, stage_of_rank: dict[int, int]) -> dict[str, Any]:
    args = {
        "ranks": list(c.ranks),
        "cross_stage": cross_stage(c, stage_of_rank),
        "async_op": c.async_op,
        "iteration": c.iteration,
    }
    return _timed_event(c.op, "collective", rank, c.start - origin, c.end - origin, args)


def _timed_event(name: str, category: str, rank: int, start: float, end: float, args: dict) -> dict[str, Any]:
    """A complete event on pipeline rank ``rank``'s track; times in seconds from the trace's origin."""
    return {
        "ph": "X",
        "pid": PID,
        "tid": rank,
        "name": name,
        "cat": category,
        "ts": start * SECONDS_TO_US,
        "dur": (end - start) * SECONDS_TO_US,
        "args": args,
    }


def _summary(ranks: list[list[PassTime]]) -> dict[str, Any]:
    """Busy time per rank and the bubble over the traced span, in seconds (the simulator's definitions)."""
    busy = [sum(t.end - t.start for t in rank if t.pass_.kind.is_compute) for rank in ranks]
    makespan = max((t.end for rank in ranks for t in rank), default=0.0)
    capacity = makespan * len(ranks)
    return {
        "pp": len(ranks),
        "measured": True,
        "time_unit_us": SECONDS_TO_US,
        "makespan_s": makespan,
        "busy_s": busy,
        "bubble_rate_makespan": (capacity - sum(busy)) / capacity if capacity else 0.0,
    }


class MetricsWriter:
    """Appends one JSON line per iteration to ``path``, flushed at once (scripts tail the file).

    Only the logging rank writes: ``enabled`` defaults to the last global rank (Megatron-LM's
    ``print_rank_last``), or True without torch.distributed. Non-finite numbers (a NaN loss)
    are written as null so every line stays strict JSON.
    """

    def __init__(self, path: str | Path, enabled: bool | None = None):
        self.path = Path(path)
        if enabled is None:
            enabled = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        self.enabled = enabled
        self._file = None

    def write(
        self, iteration: int, loss, iteration_time_s: float, bubble_rate: float | None, schedule: str, **extra
    ) -> dict | None:
        """Append one line; returns the record written (None on ranks that do not log)."""
        if not self.enabled:
            return None
        fixed = {
            "iteration": int(iteration),
            "loss": loss,
            "iteration_time_s": iteration_time_s,
            "bubble_rate": bubble_rate,
            "schedule": schedule,
        }
        record = _plain({**fixed, **extra})
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        return record

    def drop_after(self, iteration: int) -> int:
        """Remove the lines of iterations after ``iteration``; returns how many went.

        A run resumed from the checkpoint of ``iteration`` logs the iterations after it again;
        without this the file would hold them twice. A torn last line (a killed run) goes too.
        The file is replaced through a temporary file, so a kill here loses nothing.
        """
        if not self.enabled or not self.path.is_file():
            return 0
        self.close()
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if _iteration_of(line) is not None and _iteration_of(line) <= iteration]
        if len(kept) < len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            tmp.replace(self.path)
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _iteration_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(path: str | Path) -> list[dict]:
    """The records a MetricsWriter appended, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _plain(value):
    """JSON-ready: tensors and numpy scalars to Python numbers, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.item() if value.numel() == 1 else value.tolist())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _pipeline_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()
