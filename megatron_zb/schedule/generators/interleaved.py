"""Interleaved 1F1B (Megatron's virtual pipeline): each rank loops over ``chunks`` blocks.

Microbatches go through the chunks in groups of ``pp``: all chunk-0 forwards of a group, then
its chunk-1 forwards, and so on; backwards visit the chunks in reverse. Rank r warms up with
2(pp-1-r) + (chunks-1)*pp forwards, then alternates F and fused BW. A short last group
would deadlock that warm-up, so m must be a multiple of pp (or at most pp), as in Megatron.
"""

from __future__ import annotations

from ..ir import BW, F, Schedule, ScheduleError
from ..placement import interleaved
from ..registry import ScheduleSpec, register

DEFAULT_CHUNKS = 2


def chunk_order(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(chunk, microbatch) in the order a rank runs its forwards; the last group may be short."""
    order = []
    for first in range(0, microbatches, group):
        members = range(first, min(first + group, microbatches))
        order += [(chunk, mb) for chunk in range(chunks) for mb in members]
    return order


@register("interleaved-1f1b", "Megatron's interleaved 1F1B over --chunks blocks per rank; bubble / chunks")
def generate(spec: ScheduleSpec) -> Schedule:
    p, m = spec.pp, spec.microbatches
    v = DEFAULT_CHUNKS if spec.chunks is None else spec.chunks
    if v < 2:
        raise ScheduleError(f"interleaved-1f1b needs --chunks >= 2, got {v}; with one chunk use 1f1b")
    if m > p and m % p:
        below, above = m - m % p, m - m % p + p
        raise ScheduleError(
            f"interleaved-1f1b needs microbatches to be a multiple of pp={p} (or at most pp), got {m}: "
            f"a short last group makes its warm-up deadlock; use {below} or {above}, or 1f1b/zb-h1/zb-h2"
        )
    forwards = chunk_order(m, v, p)
    backwards = [(v - 1 - chunk, mb) for chunk, mb in forwards]
    total = len(forwards)
    orders = []
    for rank in range(p):
        warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
        order = [F(c * p + rank, mb) for c, mb in forwards[:warmup]]
        for (fc, fmb), (bc, bmb) in zip(forwards[warmup:], backwards[: total - warmup], strict=True):
            order += [F(fc * p + rank, fmb), BW(bc * p + rank, bmb)]
        order += [BW(c * p + rank, mb) for c, mb in backwards[total - warmup :]]
        orders.append(tuple(order))
    return Schedule("interleaved-1f1b", (interleaved(p, v),), m, tuple(orders))
