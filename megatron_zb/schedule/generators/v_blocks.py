"""V building blocks for any memory between v-min's and zb-v's (the controllable-memory paper's
adaptive scheduler, appendix A), as candidates for v-auto.

A block gives every rank a slot residue (mod 6) for F0, F1, B1, B0; W takes the first free
residue after its B. Rank 0's residues are a pattern (F0 at 0, the others distinct), and each
next rank shifts them by an offset vector: the downward passes (F0, B1) by +d, the upward
ones (F1, B0) by -1, with d = ``d_first`` on the first ``first_ranks`` hops and ``d_rest``
after. Larger d lengthens a microbatch's life on the rank: more memory, less bubble. The
microbatch-0 slots follow its data flow (each pass in the first slot after its input with
the right residue); the squeeze (v_squeeze.py) and the reordering (v_reorder.py) turn the
repeated block into orders.

There are a few hundred distinct blocks per pp, grouped by the peak memory of their plain
repetition in quarter stages; v-auto screens them level by level (v_levels.py), in the order
``all_blocks`` ranks them when it cannot screen a whole level.

The *slot model* these work in is the timing model with one slot per pass (``pack``): a rank's
passes are (type, microbatch) items, F0, F1, B1, B0 and Ws, whose chunk the model leaves open.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from functools import cache
from itertools import accumulate, permutations, starmap
from operator import add, sub

from ..costs import CostModel
from ..ir import Pass, PassKind
from ..placement import v_shape
from ..timing import spans
from .result import encoding_of, model_of

PERIOD = 6
F0, F1, B1, B0 = range(4)  # a microbatch's passes on a rank of the V, in slot-model items; higher types are Ws
W1, W0 = 4, 5  # where a W's chunk is known: the late chunk's W and the early chunk's
RISE = (1, 1, 0, 0, -1, -1)  # slot-model memory per item (chunk activations)
Quad = tuple[int, int, int, int]  # F0, F1, B1, B0 of a rank: their slots, or residues
Offsets = tuple[Quad, ...]  # per rank: absolute slots of F0, F1, B1, B0 of microbatch 0


def block_offsets(p: int, pattern: tuple[int, int, int], d_first: int, d_rest: int, first_ranks: int) -> Offsets | None:
    """Microbatch 0's slots of a block, or None if two passes of a rank share a residue."""
    hops = min(first_ranks, p - 1)
    return (_joined(_residues((0, *pattern), d_first, hops), hops, d_first, d_rest, p) or (None,))[0]


def _joined(first: list[Quad], hops: int, d_first: int, d_rest: int, p: int) -> tuple[Offsets, list[Quad]] | None:
    """The block whose first ``hops`` hops have ``first``'s residues (shifts of d_first) and the others
    d_rest's, with every rank's residues; None if two passes of a rank share a residue."""
    if len(first) <= hops:
        return None
    rest = _residues(first[hops], d_rest, p - 1 - hops)
    if len(rest) < p - hops:
        return None
    residues = first[: hops + 1] + rest[1:]
    return _walk(residues, [d_first] * hops + [d_rest] * (p - 1 - hops)), residues


def _residues(start: Quad, d: int, hops: int) -> list[Quad]:
    """Residues of up to ``hops`` ranks after ``start`` (downward passes shifted by d, upward by -1),
    stopping before the first rank where two passes would share one. The shifts repeat every 6
    ranks, so a run that gets past 5 repeats for good."""
    found = [start]
    for _ in range(min(hops, PERIOD - 1)):
        f0, f1, b1, b0 = found[-1]
        shifted = ((f0 + d) % PERIOD, (f1 - 1) % PERIOD, (b1 + d) % PERIOD, (b0 - 1) % PERIOD)
        if len(set(shifted)) < 4:
            return found
        found.append(shifted)
    return (found * (hops // PERIOD + 1))[: hops + 1]


def _walk(residues: list[Quad], downs: list[int]) -> Offsets:
    """Microbatch 0's data flow: each pass in the first slot after its input with its residue. A
    downward hop of d (F0, B1) moves d slots on, an upward one (F1, B0: residue +1) one slot."""
    ups = [1] * len(downs)
    f0 = _chain(-1, residues[0][F0], downs)
    f1 = _chain(f0[-1], residues[-1][F1], ups)[::-1]
    b1 = _chain(f1[0], residues[0][B1], downs)
    b0 = _chain(b1[-1], residues[-1][B0], ups)[::-1]
    return tuple(zip(f0, f1, b1, b0, strict=True))


def _chain(t: int, residue: int, steps: list[int]) -> list[int]:
    """Slots of a pass walking the ranks: the first slot after ``t`` with ``residue``, then ``steps`` on."""
    return list(accumulate(steps, initial=t + 1 + (residue - t - 1) % PERIOD))


def w_slots(f0: int, f1: int, b1: int, b0: int) -> tuple[int, int]:
    """W1's and W0's slots: each W in the first free residue after its B (W1 first)."""
    gap1, gap0 = _w_gaps(f0 % PERIOD, f1 % PERIOD, b1 % PERIOD, b0 % PERIOD)
    return b1 + gap1, b0 + gap0


def repeated(offsets: Sequence[Quad], reps: int) -> list[list[tuple[int, int]]]:
    """Each rank's items of the block repeated ``reps`` times; W1 and W0 take the first free residues."""
    orders = []
    for f0, f1, b1, b0 in offsets:
        w1, w0 = w_slots(f0, f1, b1, b0)
        bases = ((f0, F0), (f1, F1), (b1, B1), (b0, B0), (w1, W1), (w0, W0))
        orders.append([(t, k) for _, k, t in sorted((s + PERIOD * k, k, t) for s, t in bases for k in range(reps))])
    return orders


def item_bases(p: int, m: int) -> list[list[int]]:
    """Per rank, the codes (``timing.Encoding`` of the V) of microbatch 0's F0, F1, B1, B0, W1 and W0;
    microbatch k's are k more."""
    code, found = encoding_of((v_shape(p),), m).code, []
    for r in range(p):
        early, late = r, 2 * p - 1 - r
        kinds = ((PassKind.F, early), (PassKind.F, late), (PassKind.B, late), (PassKind.B, early))
        found.append([code(kind, block, 0) for kind, block in (*kinds, (PassKind.W, late), (PassKind.W, early))])
    return found


def chunk_codes(p: int, m: int, orders: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]]:
    """Per-rank items whose Ws say their chunk (W1, W0) as codes (``timing.Encoding`` of the V)."""
    return [[bases[t] + k for t, k in order] for bases, order in zip(item_bases(p, m), orders, strict=True)]


def as_passes(p: int, m: int, codes: Sequence[Sequence[int]]) -> list[list[Pass]]:
    """Codes of the V's passes (``timing.Encoding``) as passes."""
    decode = encoding_of((v_shape(p),), m).decode
    return [list(map(decode, order)) for order in codes]


def producer(p: int, r: int, t: int) -> tuple[int, int] | None:
    """(rank, type) of the pass of the same microbatch (the k-th W: the k-th B) that must run first:
    the V's data flow, F0 and B1 down the ranks, F1 and B0 up; None for F0 on rank 0."""
    if t >= W1:
        return r, t - 2
    source = r - 1 if t in (F0, B1) else r + 1
    if 0 <= source < p:
        return source, t
    return None if t == F0 else (r, t - 1)  # the V's turns: F0 -> F1 on the last rank, F1 -> B1 on rank 0


@cache
def _w_gaps(f0: int, f1: int, b1: int, b0: int) -> tuple[int, int]:
    """Slots from B1 to W1 and from B0 to W0: each W in the first free residue after its B."""
    used = {f0, f1, b1, b0}
    w1 = b1 + 1 + next(j for j in range(PERIOD) if (b1 + 1 + j) % PERIOD not in used)
    used.add(w1 % PERIOD)
    w0 = b0 + 1 + next(j for j in range(PERIOD) if (b0 + 1 + j) % PERIOD not in used)
    return w1 - b1, w0 - b0


@cache
def all_blocks(p: int) -> dict[Offsets, tuple[bool, int, int]]:
    """Every distinct block for pp ranks -> its rank among blocks of the same memory, as a sort key:
    (whether a downward hop has no free slot, -d_first, longest life in slots).

    A hop of one slot (d = 1) leaves no room for the comm latency, and such blocks lose with
    real costs; among the others, long first hops and a short life of a microbatch on a rank
    tend to win (measured on pp=8, m=24 with the paper's profile against all blocks).
    """
    found: dict[Offsets, tuple[bool, int, int]] = {}
    for pattern in permutations(range(1, PERIOD), 3):
        for d_first in range(1, PERIOD):
            first = _residues((0, *pattern), d_first, p - 1)  # up to the first rank where two collide
            for d_rest in range(1, d_first + 1):
                # d_rest = d_first: every first_ranks gives the same block
                for hops in range(1, min(len(first) - 1, p - 1 if d_rest < d_first else 1) + 1) if p > 1 else (0,):
                    joined = _joined(first, hops, d_first, d_rest, p)
                    if joined is None or joined[0] in found:
                        continue
                    offsets, residues = joined
                    tight = min(d_first, d_rest if hops < p - 1 else d_first) < 2
                    # life, to the later W; in C (pp 64: 3616 blocks of 64 ranks)
                    f0, _, b1, b0 = zip(*offsets, strict=True)
                    gap1, gap0 = zip(*starmap(_w_gaps, residues), strict=True)
                    life = max(map(sub, map(max, map(add, b1, gap1), map(add, b0, gap0)), f0))
                    found[offsets] = (tight, -d_first, life)
    return found


def plain_peak(offsets: Offsets, costs: CostModel) -> float:
    """Peak activation memory of the block repeated in the steady state (an upper bound for any m).

    Once every pass of microbatch 0 has run on a rank, the level after slot t counts, for each
    pass, the microbatches that have run it: (t - slot) // 6 + 1.
    """
    return _plain_peak(offsets, _rank_memory(costs))


def _rank_memory(costs: CostModel) -> list[tuple[float, ...]]:
    """Per rank: the memory F0, F1, B1, B0, W1, W0 allocate (full stages of the V's blocks, see v_shape)."""
    p = costs.pp
    found = []
    for rank in range(p):
        early, late = rank // 2, (2 * p - 1 - rank) // 2
        memory = (costs.mem_f[early], costs.mem_f[late], costs.mem_b[late], costs.mem_b[early])
        found.append(memory + (costs.mem_w[late], costs.mem_w[early]))
    return found


def _plain_peak(offsets: Offsets, memory: list[tuple[float, ...]]) -> float:
    """See ``plain_peak``. After slot t the level is the sum over passes of delta * ((t - slot) // 6 + 1).
    A stage's F, B and W deltas add up to 0, so with slot = 6q + r that is -sum(delta * q) minus the
    deltas of the passes whose residue r is above t's: the peak is the largest over t's six residues."""
    peak = -math.inf
    shapes: dict[tuple, tuple[int, int, float]] = {}
    for (f0, f1, b1, b0), mem in zip(offsets, memory, strict=True):
        f1, b1, b0 = f1 - f0, b1 - f0, b0 - f0
        key = (f1 % PERIOD, b1 % PERIOD, b0 % PERIOD, mem)
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = _rank_shape(*key)
        gap1, gap0, bonus = shape
        _, d_f1, d_b1, d_b0, d_w1, d_w0 = mem
        w1, w0 = b1 + gap1, b0 + gap0
        q = d_f1 * (f1 // PERIOD) + d_b1 * (b1 // PERIOD) + d_b0 * (b0 // PERIOD) + d_w1 * (w1 // PERIOD)
        value = bonus - (q + d_w0 * (w0 // PERIOD)) / 2
        if value > peak:
            peak = value
    return peak


@cache
def _rank_shape(f1: int, b1: int, b0: int, memory: tuple[float, ...]) -> tuple[int, int, float]:
    """For a rank's residues counted from its F0's: the slots from B1 to W1 and from B0 to W0, and
    the largest -sum(delta of the passes with a residue above t's) over t's residues."""
    gap1, gap0 = _w_gaps(0, f1, b1, b0)
    residues = (0, f1, b1, b0, (b1 + gap1) % PERIOD, (b0 + gap0) % PERIOD)
    bonus = max(
        -sum(delta for r, delta in zip(residues, memory, strict=True) if r > residue) / 2 for residue in range(PERIOD)
    )
    return gap1, gap0, bonus


def blocks_by_level(p: int, costs: CostModel) -> list[tuple[float, list[tuple[Offsets, float]]]]:
    """The blocks and the peak memory of their plain repetition, grouped by that peak in quarter
    stages (the level's upper edge), each group in ``all_blocks``'s order; lowest level first."""
    return _levels(p, costs.mem_f, costs.mem_b, costs.mem_w)


@cache
def _levels(p: int, mem_f: tuple, mem_b: tuple, mem_w: tuple) -> list[tuple[float, list[tuple[Offsets, float]]]]:
    costs = CostModel(p, mem_f=mem_f, mem_b=mem_b, mem_w=mem_w)
    blocks = all_blocks(p)
    quarter = min(mem_f) / 4
    levels: dict[int, list[tuple[Offsets, float]]] = {}
    memory = _rank_memory(costs)
    for block in sorted(blocks, key=lambda b: (blocks[b], b)):
        peak = _plain_peak(block, memory)
        levels.setdefault(math.ceil(round(peak / quarter, 6)), []).append((block, peak))
    return [(level * quarter, ranked) for level, ranked in sorted(levels.items())]


def pack(p: int, m: int, orders: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]] | None:
    """The slot of every item, as early as its rank's order and its input allow; None if the orders stall.

    The timing model with every pass one slot long and no latency.
    """
    codes = item_codes(p, m, orders)
    if codes is None:
        return None
    model = model_of((v_shape(p),), m, _one_slot(p))
    start = [0.0] * model.encoding.size
    if spans(model, codes, start) is None:
        return None
    return [list(map(int, map(start.__getitem__, row))) for row in codes]


def item_codes(p: int, m: int, orders: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]] | None:
    """Slot-model items as passes (``timing.Encoding`` codes of the V): a W belongs to the oldest B of its
    rank still without one (the slot model does not say which chunk's W runs); None if a W comes first."""
    codes = []
    for order, bases in zip(orders, item_bases(p, m), strict=True):
        waiting: deque[int] = deque()
        row = []
        for t, k in order:
            if t > B0:
                if not waiting:
                    return None
                row.append(waiting.popleft())
                continue
            row.append(bases[t] + k)
            if t >= B1:
                waiting.append(bases[t + 2] + k)  # B1's W is W1, B0's W0
        codes.append(row)
    return codes


@cache
def _one_slot(p: int) -> CostModel:
    return CostModel(p, t_f=2.0, t_b=2.0, t_w=2.0)  # per stage: each of the V's half-stage passes takes 1
