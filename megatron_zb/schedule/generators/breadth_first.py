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

from ..ir import BW, F, Pass, Schedule, ScheduleError
from ..placement import Placement, interleaved
from ..registry import ScheduleSpec, register
from .moves import by_block, fill_idle, split_filled
from .search import Move, check_memory_floor

DEFAULT_CHUNKS = 2


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


def rank_order(placement: Placement, rank: int, microbatches: int, group: int) -> list[Pass]:
    """Rank ``rank``'s passes: per group, forwards block by block, then fused backwards in reverse."""
    mine = [stage for stage in range(placement.num_stages) if placement.rank_of(stage) == rank]
    order: list[Pass] = []
    for first in range(0, microbatches, group):
        members = range(first, first + group)
        order += [F(stage, mb) for stage in mine for mb in members]
        order += [BW(stage, mb) for stage in reversed(mine) for mb in members]
    return order


def _schedule(name: str, spec: ScheduleSpec) -> Schedule:
    placement = _placement(name, spec)
    m, group = spec.microbatches, group_size(spec)
    return Schedule(name, (placement,), m, tuple(tuple(rank_order(placement, r, m, group)) for r in range(spec.pp)))


@register(
    "breadth-first",
    "breadth-first pipelining on --chunks looping blocks (ZeRO-3's schedule); GPipe at 1",
    options=("breadth_first_microbatches", "chunks"),
)
def generate(spec: ScheduleSpec) -> Schedule:
    check_memory_floor("breadth-first", forward_peak("breadth-first", spec))
    return _schedule("breadth-first", spec)


@register(
    "breadth-first-zb",
    "breadth-first with the backward split, Ws filling its idle time; never slower",
    options=("breadth_first_microbatches", "chunks"),
)
def generate_zb(spec: ScheduleSpec) -> Schedule:
    check_memory_floor("breadth-first-zb", forward_peak("breadth-first-zb", spec))
    fill = Move(lambda result: fill_idle(result, spec.cost_model(), trailing=by_block), always=True)
    return split_filled("breadth-first-zb", spec, _schedule("breadth-first-zb", spec), fill)


def forward_peak(name: str, spec: ScheduleSpec) -> float:
    """The memory a rank holds when the first group's forwards are done, on every chunk, before any backward:
    filling idle time with Ws moves no F or B, and no W comes before a B, so each order peaks at least there."""
    placement, costs, group = _placement(name, spec), spec.cost_model(), group_size(spec)
    held = [0.0] * spec.pp
    for block in range(placement.num_stages):
        held[placement.rank_of(block)] += group * costs.mem_f[placement.full_stage(block)] / placement.chunks
    return max(held)
