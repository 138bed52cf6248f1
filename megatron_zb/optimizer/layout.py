"""Where each rank's grad statistics go, and the process groups that move them without a global sync.

megatron-core reduces the grad norm² and the found-inf flag over one "grad stats" group that
spans every pipeline stage. Post-validation splits that reduction: inside a stage (a group
of the group's members on this stage, one collective that never crosses stages), then along
the pipeline, point to point, on a communicator of its own so that it never interleaves with
the schedule's activation and gradient messages.

The chained value is one float vector: a flag saying whether the first stage stepped
speculatively, one found-inf flag per sub-optimizer, and one norm² slot per member of the
grad-stats group. Keeping the members' values apart (rather than their running sum) lets the
last stage add them in the order the synchronous all-reduce would, so the norm, hence a
clipped step, is bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

SPECULATED = 0  # vector slot: the first stage stepped before knowing the full statistics


@dataclass(frozen=True)
class StatsLayout:
    """This rank's view of the chained statistics vector and its groups."""

    members: tuple[int, ...]  # global ranks of the grad-stats group, in its group-rank order
    stage_members: tuple[int, ...]  # the members on this rank's pipeline stage, in group order
    stage_group: dist.ProcessGroup | None  # None when this rank is its stage's only member
    chain_group: dist.ProcessGroup  # this pipeline's ranks, a communicator of its own
    chain_ranks: tuple[int, ...]  # global ranks of this pipeline, stage order
    stage: int
    stages: int
    found_slots: int  # sub-optimizers with a grad scaler (one found-inf flag each)

    @property
    def size(self) -> int:
        return 1 + self.found_slots + len(self.members)

    def norm_slot(self, member: int) -> int:
        return 1 + self.found_slots + self.members.index(member)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def build_layout(
    grad_stats_group: dist.ProcessGroup, pipeline_group: dist.ProcessGroup, found_slots: int
) -> StatsLayout:
    """Create the stage and chain groups (collective over the default group: call it on every rank)."""
    members = tuple(dist.get_process_group_ranks(grad_stats_group))
    chain_ranks = tuple(dist.get_process_group_ranks(pipeline_group))
    stage = pipeline_group.rank()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (members, chain_ranks, stage))
    stage_of = {rank: info[2] for rank, info in enumerate(everyone)}
    stage_sets = sorted({tuple(m for m in info[0] if stage_of[m] == stage_of[r]) for r, info in enumerate(everyone)})
    pipelines = sorted({info[1] for info in everyone})
    mine = tuple(m for m in members if stage_of[m] == stage)
    stage_group = None
    for ranks in stage_sets:  # every rank creates every group, in the same order
        if len(ranks) > 1:
            group = dist.new_group(list(ranks))
            if ranks == mine:
                stage_group = group
    chain_group = None
    for ranks in pipelines:
        group = dist.new_group(list(ranks))
        if ranks == chain_ranks:
            chain_group = group
    return StatsLayout(
        members=members,
        stage_members=mine,
        stage_group=stage_group,
        chain_group=chain_group,
        chain_ranks=chain_ranks,
        stage=stage,
        stages=len(chain_ranks),
        found_slots=found_slots,
    )
