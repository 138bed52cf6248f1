"""ZB-H1: 1F1B with the backward split, rank r keeping r Ws pending.

Warm-up and peak memory are 1F1B's; deferring W on the later ranks lets their Bs reach
rank 0 sooner, which cuts the bubble to (pp-1)(T_F+T_B-T_W).
"""

from __future__ import annotations

from collections import deque

from ..ir import B, F, Pass, Schedule, W
from ..registry import ScheduleSpec, register
from .common import linear_schedule


def rank_order(rank: int, p: int, m: int) -> list[Pass]:
    warmup = min(p - 1 - rank, m)
    pending: deque[int] = deque()  # microbatches whose W is deferred, oldest first
    order = [F(rank, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            order.append(F(rank, warmup + mb))
        order.append(B(rank, mb))
        pending.append(mb)
        if len(pending) > rank:
            order.append(W(rank, pending.popleft()))
    return order + [W(rank, mb) for mb in pending]


@register("zb-h1", "zero bubble H1: split backward, same memory as 1f1b, about a third of its bubble")
def generate(spec: ScheduleSpec) -> Schedule:
    return linear_schedule("zb-h1", spec, rank_order)
