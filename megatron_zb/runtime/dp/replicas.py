"""The rank pairs that hold the two copies of a block (BitPipe), and the sum of their gradients.

Every rank creates every pair group, in one order (``torch.distributed.new_group`` is collective
over all ranks), for every pipeline of the job: the pipelines' global ranks are gathered once.
``sum_replica_grads`` adds a chunk's gradients to those of its copy on the partner rank: the two
copies saw disjoint halves of the batch, and the loss is normalised over the whole batch, so the
sum is the full gradient, the one 1F1B computes (BitPipe's reference normalises each direction
over its half and averages instead; the result is the same). ``sum_replica_router_counts`` does the
same for what MoE routers count for their expert bias: each copy routed half of the microbatches, and
the bias update after the step must see all of them, as the single copy of 1F1B does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...schedule.ir import Schedule


def replica_groups(schedule: Schedule, pipeline: dist.ProcessGroup) -> dict[int, dist.ProcessGroup]:
    """This rank's chunk -> the group of the two ranks holding its block's copies (collective: every rank calls it)."""
    pairs = sorted(
        {
            tuple(sorted({schedule.placements[a].rank_of(s), schedule.placements[b].rank_of(t)}))
            for (a, s), (b, t) in schedule.shared
        }
    )
    mine = tuple(dist.get_process_group_ranks(pipeline))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    created: dict[tuple[int, int], dist.ProcessGroup] = {}
    for ranks in sorted(set(everyone)):
        for pair in pairs:
            group = dist.new_group([ranks[member] for member in pair])
            if ranks == mine:
                created[pair] = group
    rank, found = pipeline.rank(), {}
    for placement_index, placement in enumerate(schedule.placements):
        for stage, (owner, chunk) in enumerate(placement.blocks):
            other = schedule.replica(placement_index, stage)
            if owner == rank and other is not None:
                partner = schedule.placements[other[0]].rank_of(other[1])
                found[chunk] = created[tuple(sorted((rank, partner)))]
    return found


def sum_replica_grads(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """All-reduce (sum) every gradient of ``model`` with its copy's on the other rank of ``group``.

    Both copies are the same block built the same way, so their parameters come in the same
    order; DDP's ``main_grad`` is summed where it exists, else ``.grad``.
    """
    grads = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        if grad is not None:
            grads.append(grad)
    _sum_over(grads, group)


def sum_replica_router_counts(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum the MoE routers' token counts (``local_tokens_per_expert``, the expert bias's) with the copy's.

    The routers come in the same order on both copies; a chunk without expert-bias routers does nothing.
    """
    counts = [
        module.local_tokens_per_expert
        for module in model.modules()
        if torch.is_tensor(getattr(module, "local_tokens_per_expert", None))
    ]
    _sum_over(counts, group)


def _sum_over(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Each tensor summed in place with its copy's on the other rank of ``group``: one all-reduce for all of them."""
    if not tensors:
        return
    flat = torch.cat([tensor.reshape(-1).float() for tensor in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
