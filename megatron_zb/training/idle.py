"""Where a rank's time goes besides the passes the plan costed: its idle time, split by cause.

One executor run (``CallRecord``) on one rank spans its passes (``PassRecord``: compute,
with the time blocked on each pass's receives in ``waited``) and everything between them.
The idle part, span minus compute, splits into four parts that add up to it exactly:

- planned wait: blocked on a receive for at most as long as the simulated timeline idles
  before that pass (the bubble the plan accepted);
- unplanned wait: blocked beyond that, on a message the plan said would be there;
- send/recv: posting sends and receives, and waiting for the last sends at the end;
- Python: the rest, the executor's own work between passes.

The W split shows up in compute, not idle: ``w_split`` is what a rank's B and W passes took
beyond the fused backward (BW) of the same layers in 1F1B. The prediction from a simulated
timeline has only compute and planned wait (its B + W costs as much as BW).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from ..runtime.profiler import CallRecord, PassRecord
from ..schedule import Pass, PassKind, Schedule
from ..schedule.actions import spec
from ..schedule.simulate import Timeline


@dataclass(frozen=True)
class IdleBreakdown:
    """One rank's span (seconds) split into compute and idle parts; the idle parts add up to ``idle``."""

    span: float
    compute: float
    planned_wait: float
    unplanned_wait: float
    send_recv: float
    python: float
    w_split: float | None = None  # B + W beyond the fused BW of the same layers (inside compute); None: unknown

    @property
    def idle(self) -> float:
        return self.span - self.compute

    def to_dict(self) -> dict[str, float | None]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


def planned_gaps(timeline: Timeline, rank: int) -> dict[Pass, float]:
    """The simulated idle time right before each of ``rank``'s passes (from the timeline's start)."""
    origin = min((t.start for passes in timeline.ranks for t in passes), default=0.0)
    gaps, previous, carried = {}, origin, 0.0
    for t in timeline.ranks[rank]:
        kind = spec(t.pass_.kind)
        if not kind.blocks_compute:  # collectives run on their own stream
            continue
        gap, previous = carried + t.start - previous, t.end
        if kind.part_of:  # an all-to-all split out of the pass after it runs inside it: its wait is that pass's
            carried = gap
            continue
        gaps[t.pass_], carried = gap, 0.0
    return gaps


def predicted(timeline: Timeline, rank: int) -> IdleBreakdown:
    """The plan's breakdown: span from the timeline's start to the rank's last pass, idle all planned."""
    origin = min((t.start for passes in timeline.ranks for t in passes), default=0.0)
    passes = [t for t in timeline.ranks[rank] if spec(t.pass_.kind).blocks_compute]
    span = passes[-1].end - origin if passes else 0.0
    compute = sum(t.end - t.start for t in passes)
    return IdleBreakdown(span, compute, span - compute, 0.0, 0.0, 0.0, 0.0)


def measured(
    records: Iterable[PassRecord],
    call: CallRecord,
    gaps: dict[Pass, float],
    schedule: Schedule | None = None,
    fused_backward: Sequence[float] | None = None,
) -> IdleBreakdown:
    """Split one executor run: ``records`` are its passes (``call.iteration``'s), ``gaps`` from ``planned_gaps``.

    With ``schedule`` and ``fused_backward`` (seconds per full stage, see ``fused_backward``)
    ``w_split`` is filled in.
    """
    passes = [r for r in records if r.iteration == call.iteration and r.pass_.kind.is_compute]
    span = call.end - call.start
    compute = sum(r.end - r.start for r in passes)
    planned = sum(min(r.waited, max(gaps.get(r.pass_, 0.0), 0.0)) for r in passes)
    waited = sum(r.waited for r in passes)
    python = span - compute - waited - call.posted
    split = None
    if schedule is not None and fused_backward is not None:
        split = w_split(passes, schedule, fused_backward)
    return IdleBreakdown(span, compute, planned, waited - planned, call.posted, python, split)


def w_split(records: Iterable[PassRecord], schedule: Schedule, fused_backward: Sequence[float]) -> float:
    """Time of the split B and W passes minus the fused backward of their layers.

    ``fused_backward[s]`` is a BW pass of full stage ``s`` (1/pp of the layers); a stage of a
    placement with c chunks per rank counts as 1/c of it. Fused BW passes count zero.
    """
    extra = 0.0
    for r in records:
        if r.pass_.kind in (PassKind.B, PassKind.W):
            extra += r.end - r.start
        if r.pass_.kind is PassKind.B:
            placement = schedule.placements[r.pass_.pipe]
            extra -= fused_backward[placement.full_stage(r.pass_.stage)] / placement.chunks
    return extra


def fused_backward(sums: dict[tuple[str, int], tuple[float, int]], schedule: Schedule) -> tuple[float, ...]:
    """Mean BW time per full stage from ``stage_sums`` of a 1F1B run (every rank's, added with ``add_sums``).

    ValueError if a stage ran no BW.
    """
    found = []
    for stage in range(schedule.pp):
        total, count = sums.get(("BW", stage), (0.0, 0))
        if not count:
            raise ValueError(f"no fused BW pass of stage {stage} in the records of {schedule.name}")
        found.append(total / count)
    return tuple(found)


def mean(breakdowns: Sequence[IdleBreakdown]) -> IdleBreakdown:
    """The field-wise mean of several iterations' breakdowns (``w_split`` None if any is)."""
    if not breakdowns:
        raise ValueError("no breakdowns to average")
    values = {}
    for field in fields(IdleBreakdown):
        column = [getattr(b, field.name) for b in breakdowns]
        values[field.name] = None if any(v is None for v in column) else statistics.fmean(column)
    return IdleBreakdown(**values)


def of_iteration(profiler, schedule: Schedule, rank: int, iteration: int, costs=None) -> dict | None:
    """This rank's measured and predicted breakdown of ``iteration`` (seconds), for a metrics line.

    The plan is simulated with ``costs`` (the runner's: unit costs, or measured ones in any
    unit) and scaled so that this rank's compute matches the measured one. None when the
    profiler holds no executor run of ``iteration``.
    """
    from ..schedule import simulate

    call = next((c for c in reversed(profiler.calls) if c.iteration == iteration), None)
    if call is None:
        return None
    timeline = simulate(schedule, costs)
    gaps, plan = planned_gaps(timeline, rank), predicted(timeline, rank)
    found = measured(profiler.records, call, {}, None, None)
    scale = found.compute / plan.compute if plan.compute > 0 else 1.0
    gaps = {p: gap * scale for p, gap in gaps.items()}
    plan = IdleBreakdown(*(None if v is None else v * scale for v in plan.to_dict().values()))
    return {"measured": measured(profiler.records, call, gaps).to_dict(), "predicted": plan.to_dict()}


def for_runner(runner, profiler, iteration: int, microbatches: int, num_chunks: int) -> dict | None:
    """``of_iteration`` for the schedule a ``ForwardBackward`` runs on this pipeline rank (the launcher's row)."""
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    schedule = runner.schedule_for(pp, microbatches, num_chunks if num_chunks > 1 else None)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return of_iteration(profiler, schedule, rank, iteration, runner.costs)
