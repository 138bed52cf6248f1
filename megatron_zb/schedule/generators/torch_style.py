"""Fixed orders in the style of PyTorch's pipelining schedules, written as our own generators.

They join the automatic planners as seeds, so an automatic schedule is never worse than them
when they fit its memory limit (torch is never imported; the orders follow the published
phase structure):

- ``zbv_codes``: ZB-V on the V placement with Ws in a fixed place. Rank r warms up with
  2(pp-r)-1 early forwards, r pairs of late and early forwards and pp-r late F-B-W triples,
  then repeats early F-B-W and late F-B-W, and cools down with r B pairs, pp-r early B-W
  pairs and the deferred Ws. It is planned for at least 2pp-1 microbatches and the extra ones
  are dropped.
- ``dualpipev_orders``: DualPipeV (DeepSeek's DualPipe folded onto the V placement) as PyTorch
  writes it: rank r warms up with 2(pp-r-1) early forwards, r+1 early/late forward pairs and
  pp-r-1 late B-W-F triples; the steady state pairs a forward of one chunk with the fused
  backward of the other (PyTorch overlaps the two: ``dualpipev_pairs``, which seed the planner
  of overlapped pairs, ``pairing.py``; without pairs they run one after the other); the
  cool-down switches to split backwards halfway and places the deferred Ws last. It needs
  m >= 2pp microbatches.
- ``interleaved_zb_orders``: zero bubble on the looping placement (v chunks): interleaved
  1F1B's groups and order, one warm-up forward fewer per hop, B split from W, and rank r
  keeping r Ws pending (ZB-H1's rule per chunk).
"""

from __future__ import annotations

from functools import lru_cache

from ..ir import BW, B, F, Pass, Schedule, W
from ..pairing import Pair, register_seed
from ..placement import v_shape
from .interleaved import looped
from .v_blocks import B0, B1, F0, F1, W0, W1, chunk_codes


def zbv_codes(p: int, m: int) -> list[list[int]]:
    """PyTorch's ZB-V order as codes (``timing.Encoding`` of the V; ``v_blocks.as_passes`` reads them):
    planned for at least 2pp - 1 microbatches, the others left out."""
    total = max(2 * p - 1, m)
    items = ([(t, k) for t, k in _zbv_rank(p, total, r) if k < m] for r in range(p))
    return chunk_codes(p, m, list(items))


def _zbv_rank(p: int, total: int, r: int) -> list[tuple[int, int]]:
    """Rank r's order for ``total`` microbatches as slot-model items (F0 the early chunk's F, W1 the late one's W)."""
    count = [0] * 6
    order: list[tuple[int, int]] = []

    def run(*types: int) -> None:
        for t in types:
            order.append((t, count[t]))
            count[t] += 1

    run(*[F0] * (2 * (p - r) - 1))
    for _ in range(r):
        run(F1, F0)
    for _ in range(p - r):
        run(F1, B1, W1)
    while count[F1] < count[F0] or count[F0] < total:
        if count[F0] < total:
            run(F0)
        run(B0, W0, F1, B1, W1)
    for _ in range(r):
        run(B0, B1)
    for _ in range(p - r):
        run(B0, W0)
    run(*[W1] * (count[B1] - count[W1]), *[W0] * (count[B0] - count[W0]))
    return order


def dualpipev_orders(p: int, m: int) -> list[list[Pass]]:
    if m < 2 * p:
        raise ValueError(f"the DualPipeV order needs at least 2pp = {2 * p} microbatches, got {m}")
    return [_dualpipev_rank(p, m, r)[0] for r in range(p)]


def dualpipev_pairs(p: int, m: int) -> list[Pair]:
    """The (forward, backward) pairs PyTorch runs as OVERLAP_F_B in the DualPipeV order: each steady-state
    forward with the backward after it (not the first on the last rank), and in the phase after it the
    late forward with the early backward."""
    if m < 2 * p:
        raise ValueError(f"the DualPipeV order needs at least 2pp = {2 * p} microbatches, got {m}")
    return [pair for r in range(p) for pair in _dualpipev_rank(p, m, r)[1]]


@lru_cache(maxsize=8)
def _dualpipev_passes(p: int, m: int) -> tuple[tuple[Pass, ...], ...]:
    return tuple(map(tuple, dualpipev_orders(p, m)))


def _dualpipev_seed(schedule: Schedule) -> list[Pair]:
    """PyTorch's pairs, where ``schedule`` runs the DualPipeV order (on one V placement)."""
    p, m = schedule.pp, schedule.microbatches
    if m < 2 * p or schedule.placements != (v_shape(p),) or schedule.orders != _dualpipev_passes(p, m):
        return []
    return dualpipev_pairs(p, m)


register_seed(_dualpipev_seed)


def _dualpipev_rank(p: int, m: int, r: int) -> tuple[list[Pass], list[Pair]]:
    early, late = r, 2 * p - 1 - r
    forwards = {early: 0, late: 0}
    backwards = {early: 0, late: 0}
    pending: list[tuple[int, int]] = []  # (block, microbatch) of split backwards whose W has not run
    order: list[Pass] = []
    pairs: list[Pair] = []

    def overlapped() -> None:  # the last two passes: a forward and a backward, in either order
        first, second = order[-2:]
        pairs.append((first, second) if first.kind.value == "F" else (second, first))

    def forward(block: int) -> None:
        order.append(F(block, forwards[block]))
        forwards[block] += 1

    def backward(block: int, split: bool) -> None:
        mb = backwards[block]
        order.append(B(block, mb) if split else BW(block, mb))
        if split:
            pending.append((block, mb))
        backwards[block] += 1

    def weight() -> None:
        if pending:
            order.append(W(*pending.pop(0)))

    for _ in range(2 * (p - r - 1)):
        forward(early)
    for _ in range(r + 1):
        forward(early)
        forward(late)
    for _ in range(p - r - 1):
        backward(late, split=True)
        weight()
        forward(late)
    for i in range(m - 2 * p + r + 1):
        forward(early)
        backward(late, split=False)
        if i > 0 or r < p - 1:  # the last rank's first late backward waits for its forward just before
            overlapped()
        forward(late)
        backward(early, split=False)
        overlapped()
    for _ in range(p - r - 1):
        backward(late, split=False)
        forward(late)
        backward(early, split=False)
        overlapped()
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(late, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(early, split)
    for _ in range(p - r - 1):
        weight()
        backward(early, split)
    while pending:
        weight()
    return order, pairs


def interleaved_zb_orders(p: int, m: int, v: int) -> list[list[Pass]]:
    groups, forwards, backwards = looped(p, m, v)
    total, orders = len(forwards), []
    for r in range(p):
        warmup = min((v - 1) * groups[0] + p - 1 - r, total)
        order = [F(c * p + r, mb) for c, mb in forwards[:warmup]]
        weights = 0
        for j, (c, mb) in enumerate(backwards):
            if warmup + j < total:
                fc, fmb = forwards[warmup + j]
                order.append(F(fc * p + r, fmb))
            order.append(B(c * p + r, mb))
            if j >= r:
                wc, wmb = backwards[weights]
                order.append(W(wc * p + r, wmb))
                weights += 1
        order += [W(c * p + r, mb) for c, mb in backwards[weights:]]
        orders.append(order)
    return orders


@lru_cache(maxsize=8)
def interleaved_zb_passes(p: int, m: int, v: int) -> tuple[tuple[Pass, ...], ...]:
    """``interleaved_zb_orders`` as a schedule's orders, made once per setting: ``auto`` times it as PyTorch's
    order and zb-1p and zb-2p seed from it, and one orders object is timed once (``result.remember``)."""
    return tuple(map(tuple, interleaved_zb_orders(p, m, v)))
