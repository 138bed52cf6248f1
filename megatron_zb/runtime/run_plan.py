"""What one rank derives from one schedule to run it: built once, dropped as a unit on re-plan.

Before a schedule runs it is lowered with the run's data-parallel actions, turned into this
rank's passes and messages (``executor.plan_rank``), cut for optimizer post-validation
(``schedule.speculation``), and, for BitPipe, given the process groups of its blocks' two
copies. Cached apart, keyed by ``id()`` of a schedule, these went stale: a re-plan released the
old lowered schedule, a new one could be allocated at its id and pick up the old one's
post-validation prefix. A ``RunPlan`` holds them next to the schedule they came from, and
``RunPlans`` forgets all of them at once when the schedule changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch.distributed as dist

from ..schedule import CostModel, PassKind, Schedule, schedule_from_data, schedule_to_data
from ..schedule.lower import DataParallel, lower
from ..schedule.speculation import Speculation, speculation
from .dp.replicas import replica_groups
from .executor import PrefixCheck, RankPlan, plan_rank


class Setting(NamedTuple):
    """What a schedule is planned for; the key every schedule and run plan is cached under."""

    pp: int
    microbatches: int
    chunks: int | None  # model chunks per rank; None: the generator's own default


@dataclass
class RunPlan:
    """One schedule, lowered for one data-parallel setting, as one pipeline rank runs it."""

    schedule: Schedule  # the compute schedule every rank agreed on
    lowered: Schedule  # with the data-parallel actions of the run
    rank: int  # pipeline rank
    replica_groups: dict[int, dist.ProcessGroup]  # chunk -> group of the two ranks holding its block (BitPipe)
    partial_chunks: frozenset[int]  # chunks whose forwards run only some microbatches (several pipes)
    _rank_plans: dict[bool, RankPlan] = field(default_factory=dict, repr=False)

    def rank_plan(self, forward_only: bool) -> RankPlan:
        """This rank's passes with their receives and sends (forward-only: the backward passes left out)."""
        if forward_only not in self._rank_plans:
            self._rank_plans[forward_only] = plan_rank(self.lowered, self.rank, forward_only)
        return self._rank_plans[forward_only]

    @cached_property
    def speculation(self) -> Speculation:
        """Every rank's post-validation prefix of the lowered schedule (computed when first needed)."""
        return speculation(self.lowered)

    def prefix_check(self, settle: Callable[[], bool]) -> PrefixCheck:
        """Where this rank checks a pending optimizer step, and what to drain if it is redone."""
        found = self.speculation
        return PrefixCheck(found.prefix[self.rank], found.sent_in_prefix[self.rank], settle)


class RunPlans:
    """The schedule of each setting and the run plans derived from it; ``drop`` forgets them together."""

    def __init__(self) -> None:
        self._schedules: dict[Setting, Schedule] = {}
        self._runs: dict[tuple[Setting, DataParallel, dist.ProcessGroup], RunPlan] = {}

    def schedule(self, setting: Setting, plan: Callable[[], Schedule]) -> Schedule:
        """The setting's schedule, planned with ``plan`` the first time it is asked for."""
        if setting not in self._schedules:
            self._schedules[setting] = plan()
        return self._schedules[setting]

    def run_plan(
        self, setting: Setting, data_parallel: DataParallel, pipeline: dist.ProcessGroup, costs: CostModel | None
    ) -> RunPlan:
        """The run plan of the setting's schedule (``schedule`` first); the first call for a BitPipe
        schedule creates its replica pair groups, collectively on every rank."""
        key = (setting, data_parallel, pipeline)
        if key not in self._runs:
            schedule, rank = self._schedules[setting], pipeline.rank()
            sibling = next(
                (run for (s, _, group), run in self._runs.items() if (s, group) == (setting, pipeline)), None
            )
            if sibling is not None:  # another lowering of the same schedule: its pair groups serve this one too
                groups = sibling.replica_groups
            else:
                groups = replica_groups(schedule, pipeline) if schedule.shared else {}
            lowered = lower(schedule, data_parallel, costs)
            self._runs[key] = RunPlan(schedule, lowered, rank, groups, partial_chunks(schedule, rank))
        return self._runs[key]

    def drop(self) -> None:
        """Forget every schedule and everything derived from one (new costs: plan again)."""
        self._schedules.clear()
        self._runs.clear()

    def replan(self, setting: Setting, schedule: Schedule) -> None:
        """From now on ``setting`` runs ``schedule``; everything planned before is forgotten."""
        self.drop()
        self._schedules[setting] = schedule


def partial_chunks(schedule: Schedule, rank: int) -> frozenset[int]:
    """This rank's chunks that run the forwards of only some of the microbatches (several pipes)."""
    if len(schedule.placements) == 1:
        return frozenset()
    counts: dict[int, int] = {}
    for p in schedule.orders[rank]:
        if p.kind is PassKind.F:
            counts[schedule.chunk_of(p)] = counts.get(schedule.chunk_of(p), 0) + 1
    return frozenset(chunk for chunk, count in counts.items() if count < schedule.microbatches)


def broadcast_schedule(schedule: Schedule | None) -> Schedule:
    """Rank 0's ``schedule`` on every rank, every field of it (the others pass None).

    For planning that is not deterministic across processes (CP-SAT refinement).
    """
    payload = [schedule_to_data(schedule) if schedule is not None else None]
    dist.broadcast_object_list(payload, src=0)
    return schedule_from_data(payload[0])
