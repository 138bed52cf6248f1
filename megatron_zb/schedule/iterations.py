"""Several iterations back to back: what optimizer post-validation buys.

One simulated iteration gives two bubble metrics (``simulate.py``); which one a run pays
depends on how an iteration hands over to the next. A synchronising optimizer step (the
grad-norm all-reduce) makes every rank wait for the slowest one, so each iteration costs
the makespan. With post-validation the partial grad statistics travel from rank 0 to rank
p-1 and each rank steps as soon as it has its own gradients and the partial, so a rank that
finishes early starts the next iteration early and the iterations overlap across ranks.
Simulating them back to back shows the steady-state time per iteration (``period``) of both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .costs import CostModel
from .execute import Span, execute
from .ir import Pass, Schedule, ScheduleError
from .simulate import PassTime, Timeline, memory_levels


@dataclass(frozen=True)
class IterationsTimeline:
    """Consecutive iterations of one schedule; iteration k runs microbatches k*m .. k*m+m-1."""

    timeline: Timeline  # all iterations in one Timeline, for the renderers
    post_validation: bool
    starts: tuple[tuple[float, ...], ...]  # [iteration][rank]: when the rank may start it (its step is done)
    ends: tuple[tuple[float, ...], ...]  # [iteration][rank]: end of the rank's last pass of the iteration

    @property
    def iterations(self) -> int:
        return len(self.ends)

    @property
    def period(self) -> float:
        """Steady-state time per iteration: the largest gap between a rank's last two iteration ends.

        From the cold start of iteration 0 the first hand-over can differ from later ones when
        costs differ per stage; three iterations reached the steady state in a random sweep.
        """
        last, previous = self.ends[-1], self.ends[-2]
        return max(end - before for end, before in zip(last, previous, strict=True))


def simulate_iterations(
    schedule: Schedule,
    costs: CostModel | None = None,
    iterations: int = 2,
    post_validation: bool = False,
    step_time: float = 0.0,
) -> IterationsTimeline:
    """Run ``iterations`` copies of ``schedule`` back to back, each rank stepping between them.

    Without post-validation every rank starts iteration k+1 at the latest end of iteration k
    plus one collective latency (``costs.t_comm``) plus ``step_time``. With it, rank r starts
    once it has its own end and the partial statistics chained from rank 0 (one ``t_comm`` per
    hop), plus ``step_time``. Inside an iteration the dependency rule applies as in ``simulate``.
    """
    costs = costs or CostModel(schedule.pp)
    if costs.pp != schedule.pp:
        raise ValueError(f"cost model is for pp={costs.pp}, schedule {schedule.name} has pp={schedule.pp}")
    if iterations < 2:
        raise ScheduleError(f"iterations must be at least 2 to measure a period, got {iterations}")
    if not step_time >= 0:
        raise ScheduleError(f"step_time must not be negative, got {step_time}")

    def duration(p: Pass) -> float:
        return costs.duration(p, schedule.placements[p.pipe])

    spans: list[list[Span]] = [[] for _ in schedule.orders]
    starts, ends = [], []
    ready = (0.0,) * schedule.pp
    for _ in range(iterations):
        iteration = execute(
            schedule, duration, costs.t_comm, ready, lambda f, b: costs.pair_time(f, b, schedule.placements)
        )
        end = tuple(s[-1].end if s else at for s, at in zip(iteration, ready, strict=True))
        for rank, rank_spans in enumerate(iteration):
            spans[rank].extend(rank_spans)
        starts.append(ready)
        ends.append(end)
        ready = _next_start(end, costs.t_comm, step_time, post_validation)
    combined = repeat(schedule, iterations, "post-validation" if post_validation else "synchronous step")
    ranks = tuple(
        tuple(
            PassTime(p, rank, combined.chunk_of(p), span.start, span.end)
            for p, span in zip(combined.orders[rank], spans[rank], strict=True)
        )
        for rank in range(combined.pp)
    )
    timeline = Timeline(combined, costs, ranks, memory_levels(combined, costs))
    return IterationsTimeline(timeline, post_validation, tuple(starts), tuple(ends))


def _next_start(end: Sequence[float], t_comm: float, step_time: float, post_validation: bool) -> tuple[float, ...]:
    """When each rank may start the next iteration, given when it ended this one."""
    if not post_validation:
        return (max(end) + t_comm + step_time,) * len(end)
    partial: list[float] = []
    for rank, own in enumerate(end):
        partial.append(own if rank == 0 else max(own, partial[-1] + t_comm))
    return tuple(at + step_time for at in partial)


def repeat(schedule: Schedule, iterations: int, label: str = "") -> Schedule:
    """One schedule running ``iterations`` copies of the orders, microbatches offset by k*m."""
    if any(not p.kind.per_microbatch for order in schedule.orders for p in order):  # the all-to-alls repeat
        raise ScheduleError(
            f"{schedule.name}: iterations back to back are simulated on the compute schedule; lower each "
            "iteration's data-parallel actions separately"
        )
    m = schedule.microbatches
    orders = tuple(
        tuple(replace(p, microbatch=p.microbatch + k * m) for k in range(iterations) for p in order)
        for order in schedule.orders
    )
    name = f"{schedule.name} x{iterations}" + (f" ({label})" if label else "")
    overlapped = tuple(
        tuple(replace(p, microbatch=p.microbatch + k * m) for p in pair)
        for k in range(iterations)
        for pair in schedule.overlapped
    )
    return replace(schedule, name=name, microbatches=iterations * m, orders=orders, overlapped=overlapped)
