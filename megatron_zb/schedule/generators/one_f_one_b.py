"""1F1B: warm up with forwards, alternate one F and one fused BW, drain the BWs."""

from __future__ import annotations

from ..ir import BW, F, Pass, Schedule
from ..registry import ScheduleSpec, register
from .common import linear_schedule


def rank_order(rank: int, p: int, m: int) -> list[Pass]:
    warmup = min(p - 1 - rank, m)
    order = [F(rank, mb) for mb in range(warmup)]
    for steady in range(m - warmup):
        order += [F(rank, warmup + steady), BW(rank, steady)]
    return order + [BW(rank, mb) for mb in range(m - warmup, m)]


@register("1f1b", "Megatron's default: F and fused BW alternate; peak pp microbatches on rank 0")
def generate(spec: ScheduleSpec) -> Schedule:
    return linear_schedule("1f1b", spec, rank_order)
