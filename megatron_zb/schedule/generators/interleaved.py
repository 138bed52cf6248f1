"""Interleaved 1F1B (Megatron's virtual pipeline): each rank loops over ``chunks`` blocks.

Microbatches go through the chunks in groups: all chunk-0 forwards of a group, then its
chunk-1 forwards, and so on; backwards visit the chunks in reverse. Rank r warms up with
2(pp-1-r) + (chunks-1)*g forwards (g the first group's size), then alternates F and fused BW.
Groups are pp microbatches when pp divides m, as in Megatron. Otherwise m is split into m // pp
groups of near-equal size (each at least pp), as PyTorch's ScheduleInterleaved1F1B does when
the groups come out equal: a group shorter than pp would deadlock the warm-up, so any m runs.
"""

from __future__ import annotations

from ..ir import BW, F, Schedule, ScheduleError
from ..placement import interleaved
from ..registry import ScheduleSpec, register

DEFAULT_CHUNKS = 2


def group_sizes(microbatches: int, pp: int) -> list[int]:
    """Microbatches per group: m // pp groups of near-equal size (larger ones first), or one group if m <= pp."""
    if microbatches <= pp:
        return [microbatches]
    groups = microbatches // pp
    size, larger = divmod(microbatches, groups)
    return [size + 1] * larger + [size] * (groups - larger)


def looped(p: int, m: int, v: int) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """The groups, and the (chunk, microbatch) order of a rank's forwards (group by group) and of its
    backwards (chunks reversed)."""
    groups, forwards, first = group_sizes(m, p), [], 0
    for size in groups:
        forwards += [(chunk, mb) for chunk in range(v) for mb in range(first, first + size)]
        first += size
    return groups, forwards, [(v - 1 - chunk, mb) for chunk, mb in forwards]


@register(
    "interleaved-1f1b",
    "Megatron's interleaved 1F1B over --chunks blocks per rank; bubble / chunks",
    options=("chunks",),
)
def generate(spec: ScheduleSpec) -> Schedule:
    p, m = spec.pp, spec.microbatches
    v = DEFAULT_CHUNKS if spec.chunks is None else spec.chunks
    if v < 2:
        raise ScheduleError(f"interleaved-1f1b needs --chunks >= 2, got {v}; with one chunk use 1f1b")
    groups, forwards, backwards = looped(p, m, v)
    total, orders = len(forwards), []
    for rank in range(p):
        warmup = min(2 * (p - 1 - rank) + (v - 1) * groups[0], total)
        order = [F(c * p + rank, mb) for c, mb in forwards[:warmup]]
        for (fc, fmb), (bc, bmb) in zip(forwards[warmup:], backwards[: total - warmup], strict=True):
            order += [F(fc * p + rank, fmb), BW(bc * p + rank, bmb)]
        order += [BW(c * p + rank, mb) for c, mb in backwards[total - warmup :]]
        orders.append(tuple(order))
    return Schedule("interleaved-1f1b", (interleaved(p, v),), m, tuple(orders))
