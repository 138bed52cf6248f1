"""Timing and memory simulator: when every pass runs, and what it costs in bubbles and memory.

Both bubble metrics are reported. Stage-span bubble measures each rank from its first to
its last pass (iterations may overlap across ranks, as with optimizer post-validation);
makespan bubble measures from the first pass anywhere to the last one (a synchronizing
optimizer step ends every iteration). Either is the idle fraction of rank-time. Work is what
holds the compute stream: the compute passes and the all-to-alls split out of them (so splitting
them out changes no bubble); collectives run beside it on their own stream, and count only where
something waits for them (a span ends when the rank's last action, a gradient reduction included,
ends). The two passes of an overlapped pair (``Schedule.overlapped``) share one span, the pair's
time (``CostModel.pair_time``), counted once as work. Memory stays per pass, in order: a pair's
forward and backward change it one after the other as the order lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from .actions import spec
from .costs import CostModel
from .deps import order_inputs, roles
from .execute import execute
from .ir import Pass, Schedule


@dataclass(frozen=True)
class PassTime:
    pass_: Pass
    rank: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    costs: CostModel
    ranks: tuple[tuple[PassTime, ...], ...]
    memory: tuple[tuple[float, ...], ...]  # level after each pass, per rank, in order

    @property
    def peak_memory(self) -> tuple[float, ...]:
        return tuple(max((0.0, *levels)) for levels in self.memory)

    @property
    def work(self) -> tuple[float, ...]:
        """Time each rank's compute stream is busy (an overlapped pair's one span counted once)."""
        seconds = {backward for _, backward in self.schedule.overlapped}
        return tuple(
            sum(t.end - t.start for t in rank if spec(t.pass_.kind).blocks_compute and t.pass_ not in seconds)
            for rank in self.ranks
        )

    @property
    def makespan(self) -> float:
        ends = [t.end for rank in self.ranks for t in rank]
        starts = [t.start for rank in self.ranks for t in rank]
        return max(ends, default=0.0) - min(starts, default=0.0)

    def rank_span(self, rank: int) -> float:
        """From the rank's first work (or the gather it waited for) to its last action's end."""
        passes = self.ranks[rank]
        first = next((i for i, t in enumerate(passes) if spec(t.pass_.kind).blocks_compute), None)
        if first is None:
            return 0.0
        start = passes[first].start
        if first == 0:
            return max(t.end for t in passes) - start
        waited_for = set(order_inputs(self.schedule).inputs[rank][first])
        for t in passes[:first]:
            if waited_for.intersection(roles(t.pass_)) and t.end >= start - 1e-12:
                start = min(start, t.start)  # an exposed gather is part of the iteration
        return max(t.end for t in passes) - start

    @property
    def stage_span(self) -> float:
        return max(self.rank_span(r) for r in range(len(self.ranks)))

    def _bubble(self, span: float) -> float:
        capacity = span * len(self.ranks)
        return (capacity - sum(self.work)) / capacity if capacity else 0.0

    @property
    def bubble_rate(self) -> float:
        """Stage-span bubble: idle fraction of rank-time within the longest rank span."""
        return self._bubble(self.stage_span)

    @property
    def bubble_rate_makespan(self) -> float:
        return self._bubble(self.makespan)

    def to_dict(self) -> dict:
        """The object ``megatron-zb plan --format json`` prints; both passes of the n-th overlapped pair carry
        ``"pair": n``."""
        schedule = self.schedule
        pair_of = {p: n for n, pair in enumerate(schedule.overlapped) for p in pair}
        return {
            "schedule": schedule.name,
            "pp": schedule.pp,
            "microbatches": schedule.microbatches,
            "chunks": schedule.chunks,
            "placement": [placement.kind for placement in schedule.placements],
            "makespan": self.makespan,
            "stage_span": self.stage_span,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_makespan": self.bubble_rate_makespan,
            "peak_memory": list(self.peak_memory),
            **({"overlapped_pairs": len(schedule.overlapped)} if schedule.overlapped else {}),
            "ranks": [
                [
                    {
                        "pass": t.pass_.kind.value,
                        "stage": t.pass_.stage,
                        "chunk": t.chunk,
                        "microbatch": t.pass_.microbatch,
                        **({"pipe": t.pass_.pipe} if t.pass_.pipe else {}),
                        **({} if t.pass_.kind.is_compute else {"stream": spec(t.pass_.kind).stream.value}),
                        **({"pair": pair_of[t.pass_]} if t.pass_ in pair_of else {}),
                        "start": t.start,
                        "end": t.end,
                    }
                    for t in rank
                ]
                for rank in self.ranks
            ],
        }


def memory_levels(schedule: Schedule, costs: CostModel) -> tuple[tuple[float, ...], ...]:
    """Activation memory after each pass, per rank; timing does not change it, order does."""
    return tuple(
        tuple(accumulate(costs.memory_delta(p, schedule.placements[p.pipe]) for p in order))
        for order in schedule.orders
    )


def simulate(schedule: Schedule, costs: CostModel | None = None) -> Timeline:
    costs = costs or CostModel(schedule.pp)
    if costs.pp != schedule.pp:
        raise ValueError(f"cost model is for pp={costs.pp}, schedule {schedule.name} has pp={schedule.pp}")
    spans = execute(
        schedule,
        lambda p: costs.duration(p, schedule.placements[p.pipe]),
        costs.t_comm,
        paired=lambda forward, backward: costs.pair_time(forward, backward, schedule.placements),
    )
    ranks = tuple(
        tuple(
            PassTime(p, rank, schedule.chunk_of(p), span.start, span.end)
            for p, span in zip(schedule.orders[rank], rank_spans, strict=True)
        )
        for rank, rank_spans in enumerate(spans)
    )
    return Timeline(schedule, costs, ranks, memory_levels(schedule, costs))
