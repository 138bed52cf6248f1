"""1F1B: warm up with forwards, alternate one F and one fused BW, drain the BWs."""

from __future__ import annotations

from ..ir import BW, F, Schedule
from ..placement import linear
from ..registry import ScheduleSpec, register
from .common import single_chunk


@register("1f1b", "Megatron's default: F and fused BW alternate; peak pp microbatches on rank 0")
def generate(spec: ScheduleSpec) -> Schedule:
    single_chunk(spec, "1f1b", "use interleaved-1f1b for several chunks per rank")
    p, m = spec.pp, spec.microbatches
    orders = []
    for rank in range(p):
        warmup = min(p - 1 - rank, m)
        order = [F(rank, mb) for mb in range(warmup)]
        for steady in range(m - warmup):
            order += [F(rank, warmup + steady), BW(rank, steady)]
        order += [BW(rank, mb) for mb in range(m - warmup, m)]
        orders.append(tuple(order))
    return Schedule("1f1b", (linear(p),), m, tuple(orders))
