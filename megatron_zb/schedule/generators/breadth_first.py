"""Breadth-first pipelining (Lamy-Poirier 2023; Fast-LLM, PyTorch's ScheduleLoopedBFS), and with B/W split.

On the looping placement (chunk c of rank r holds block c*pp + r) the microbatches run in
groups of ``breadth_first_microbatches``: every microbatch of a group passes through a block
before the group moves to the next block, and the backward visits the blocks in reverse the
same way. A rank therefore works on one chunk for a whole group at a time, which is what lets
ZeRO-3 gather a chunk's weights once per group and reduce its gradients once (see lower.py).
The groups (``depth_first`` = m / group of them) run one after the other, each a full fill and
drain. With unit costs the bubble equals interleaved 1F1B's, (pp-1)/(chunks*m) of the work,
but a rank holds the activations of the whole group; one chunk per rank is GPipe.

``breadth-first-zb`` runs the same F and B order with the backward split and places each W
in the idle time the plain order leaves (the turn from forward to backward, the drain), oldest
first, the rest after the rank's last B, chunk by chunk starting with the chunk the rank ran
last (so ZeRO-3 keeps its weights gathered). Filling idle time never delays another pass, so it is
never slower than ``breadth-first``; the price is that a deferred W delays its chunk's gradient
reduction, which the simulator shows once the schedule is lowered with REDUCE_GRAD.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from ..costs import CostModel
from ..ir import F, Pass, PassKind, Schedule, ScheduleError, W
from ..placement import Placement, interleaved
from ..registry import ScheduleSpec, register
from ..simulate import simulate

DEFAULT_CHUNKS = 2
EPS = 1e-9


def group_size(spec: ScheduleSpec) -> int:
    """Microbatches per breadth-first group: the one asked for, or the whole batch."""
    m = spec.microbatches
    size = spec.breadth_first_microbatches or m
    if size < 1 or m % size:
        raise ScheduleError(
            f"--breadth-first-micro-batches {size} must divide the microbatches ({m}): "
            f"microbatches = breadth-first x depth-first micro-batches (e.g. {m} x 1)"
        )
    return size


def _placement(name: str, spec: ScheduleSpec) -> Placement:
    chunks = DEFAULT_CHUNKS if spec.chunks is None else spec.chunks
    if chunks < 1:
        raise ScheduleError(f"{name} needs --chunks >= 1, got {chunks}")
    return interleaved(spec.pp, chunks)


def rank_order(placement: Placement, rank: int, microbatches: int, group: int, backward: PassKind) -> list[Pass]:
    """Rank ``rank``'s passes: per group, forwards block by block, then backwards in reverse."""
    mine = [stage for stage in range(placement.num_stages) if placement.rank_of(stage) == rank]
    order: list[Pass] = []
    for first in range(0, microbatches, group):
        members = range(first, first + group)
        order += [F(stage, mb) for stage in mine for mb in members]
        order += [Pass(backward, stage, mb) for stage in reversed(mine) for mb in members]
    return order


@register(
    "breadth-first",
    "breadth-first pipelining on --chunks looping blocks (ZeRO-3's schedule); GPipe at 1",
    options=("breadth_first_microbatches",),
)
def generate(spec: ScheduleSpec) -> Schedule:
    placement = _placement("breadth-first", spec)
    m, group = spec.microbatches, group_size(spec)
    orders = tuple(tuple(rank_order(placement, r, m, group, PassKind.BW)) for r in range(spec.pp))
    return Schedule("breadth-first", (placement,), m, orders)


@register(
    "breadth-first-zb",
    "breadth-first with the backward split, Ws filling its idle time; never slower",
    options=("breadth_first_microbatches",),
)
def generate_zb(spec: ScheduleSpec) -> Schedule:
    placement = _placement("breadth-first-zb", spec)
    m, group = spec.microbatches, group_size(spec)
    split = tuple(tuple(rank_order(placement, r, m, group, PassKind.B)) for r in range(spec.pp))
    plain = Schedule("breadth-first-zb", (placement,), m, split)
    return fill_idle_with_w(plain, spec.cost_model())


def fill_idle_with_w(schedule: Schedule, costs: CostModel) -> Schedule:
    """Each rank's Ws, oldest first, in the idle gaps of its F/B timeline they fit in; the rest at the end."""
    timeline = simulate(schedule, costs)
    orders = []
    for passes in timeline.ranks:
        pending: deque[tuple[float, Pass]] = deque()  # (when its B ends, the W)
        order: list[Pass] = []
        free = passes[0].start if passes else 0.0
        for t in passes:
            while pending and pending[0][0] <= free + EPS:
                w = pending[0][1]
                length = costs.duration(w, schedule.placements[w.pipe])
                if free + length > t.start + EPS:
                    break
                order.append(pending.popleft()[1])
                free += length
            order.append(t.pass_)
            free = t.end
            if t.pass_.kind is PassKind.B:
                pending.append((t.end, W(t.pass_.stage, t.pass_.microbatch, t.pass_.pipe)))
        order += _trailing([w for _, w in pending], order[-1].stage if order else None)
        orders.append(tuple(order))
    return replace(schedule, orders=tuple(orders))


def _trailing(ws: list[Pass], last_stage: int | None) -> list[Pass]:
    """The Ws left after the last B, grouped by chunk: the chunk that ran last first, then by age."""
    stages = list(dict.fromkeys(w.stage for w in ws))
    if last_stage in stages:
        stages.remove(last_stage)
        stages.insert(0, last_stage)
    return [w for stage in stages for w in ws if w.stage == stage]
