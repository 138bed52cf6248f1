"""ZB-H2: more warm-up forwards and Ws held back to fill the tail; zero bubble for m >= 2pp-1.

Rank r starts with 2(pp-r)-1 forwards (peak 2pp-1 microbatches on rank 0), then runs
B, W, F while keeping 2r Ws pending, so the last rank has 2pp-1 Ws left for the cool-down.
With fewer microbatches it keeps only m-pp+r pending (the tail is shorter), and both its
stage span, max(3m, 2m+2pp-1), and its makespan, max(3m+pp-1, 2m+2pp-1), reach the lower
bound for any schedule with unit costs.
"""

from __future__ import annotations

from collections import deque

from ..ir import B, F, Pass, Schedule, W
from ..registry import ScheduleSpec, register
from .common import linear_schedule


def rank_order(rank: int, p: int, m: int) -> list[Pass]:
    warmup = min(2 * (p - rank) - 1, m)
    keep = min(2 * rank, max(0, m - p + rank))
    pending: deque[int] = deque()  # microbatches whose W is deferred, oldest first
    order = [F(rank, mb) for mb in range(warmup)]
    for mb in range(m):
        order.append(B(rank, mb))
        pending.append(mb)
        if len(pending) > keep:
            order.append(W(rank, pending.popleft()))
        if warmup + mb < m:
            order.append(F(rank, warmup + mb))
    return order + [W(rank, mb) for mb in pending]


@register("zb-h2", "zero bubble H2: split backward, zero bubble for m >= 2pp-1, peak 2pp-1 microbatches")
def generate(spec: ScheduleSpec) -> Schedule:
    return linear_schedule("zb-h2", spec, rank_order)
