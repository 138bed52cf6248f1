"""Grad statistics as megatron-core computes them, minus the reduction across pipeline stages.

``prepare_local`` does what ``MegatronOptimizer.prepare_grads`` does on one rank (main grads
from the model grads, unscaled, found-inf flag) without the all-reduce and without updating
the grad scaler: the scaler waits for the global flag. ``local_norm_sq`` is the value
``get_grad_norm_fp32`` feeds into its all-reduce. ``Verdict`` turns a full statistics vector
into what the synchronous ``ChainedOptimizer.step`` would have done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import SPECULATED, StatsLayout


def prepare_local(sub, device: torch.device) -> torch.Tensor | None:
    """Main grads ready and unscaled; this rank's found-inf flag (None without a grad scaler)."""
    if getattr(sub, "is_stub_optimizer", False):
        return torch.zeros(1, dtype=torch.float, device=device) if getattr(sub, "grad_scaler", None) else None
    if hasattr(sub, "_copy_model_grads_to_main_grads"):
        sub._copy_model_grads_to_main_grads()
    else:  # FP32Optimizer.prepare_grads
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad
    scaler = getattr(sub, "grad_scaler", None)
    if not scaler:
        return None
    found = torch.zeros(1, dtype=torch.float, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(
        sub._collect_main_grad_data_for_unscaling(), found, scaler.inv_scale
    )
    return found


def local_norm_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's norm² in float32, computed as get_grad_norm_fp32 computes it before its all-reduce."""
    from megatron.core.optimizer import clip_grads

    if not grads:
        return torch.zeros(1, dtype=torch.float, device=device)
    overflow = torch.zeros(1, dtype=torch.int, device=device)
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
    return norm**2.0


def fill_stage_slots(
    vector: torch.Tensor, layout: StatsLayout, found: list[torch.Tensor], norm_sq: torch.Tensor
) -> None:
    """Write this stage's statistics into ``vector`` (one collective inside the stage)."""
    mine = torch.cat([*found, norm_sq.reshape(1).float()]) if found else norm_sq.reshape(1).float()
    if layout.stage_group is None:
        rows, ranks = [mine], [dist.get_rank()]
    else:
        rows = [torch.empty_like(mine) for _ in range(layout.stage_group.size())]
        dist.all_gather(rows, mine, group=layout.stage_group)
        ranks = dist.get_process_group_ranks(layout.stage_group)
    for rank, row in zip(ranks, rows, strict=True):
        for index in range(layout.found_slots):
            vector[1 + index] = torch.maximum(vector[1 + index], row[index])
        vector[layout.norm_slot(rank)] = row[-1]


def allreduce_order_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum float32 values in the order gloo's all-reduce adds a one-element tensor over the group.

    Checked for 2 to 8 ranks (tests/optimizer): the last member's value first, then each
    earlier one added in front. NCCL's order is its own, so on GPUs a clipped step may
    differ from the synchronous one in the last bit of the norm.
    """
    total = values[-1].clone()
    for value in reversed(values[:-1]):
        total = value + total
    return total


@dataclass(frozen=True)
class Verdict:
    """What the synchronous step does with these statistics."""

    found_inf: tuple[bool, ...]  # per sub-optimizer with a grad scaler
    grad_norm: float | None  # None when the step is skipped (as megatron-core reports it)
    clip: bool  # some gradients get scaled down

    @property
    def skip(self) -> bool:
        return any(self.found_inf)

    @property
    def plain(self) -> bool:
        """A step with neither skipping nor clipping: what speculation assumes."""
        return not self.skip and not self.clip


def verdict(vector: torch.Tensor, layout: StatsLayout, clip_grad: float) -> Verdict:
    """The decision of ``ChainedOptimizer.step`` for these statistics (missing members count zero)."""
    found = tuple(bool(vector[1 + index].item() > 0) for index in range(layout.found_slots))
    if any(found):
        return Verdict(found, None, False)
    start = 1 + layout.found_slots
    norm = allreduce_order_sum(vector[start:]).item() ** (1.0 / 2.0)
    clip = clip_grad > 0.0 and clip_grad / (norm + 1.0e-6) < 1.0
    return Verdict(found, norm, clip)


def speculated(vector: torch.Tensor) -> bool:
    return bool(vector[SPECULATED].item() > 0)
