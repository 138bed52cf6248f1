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
"""

from __future__ import annotations

import math
from functools import cache
from itertools import permutations

from ..costs import CostModel

PERIOD = 6
Offsets = tuple[tuple[int, int, int, int], ...]  # per rank: absolute slots of F0, F1, B1, B0 of microbatch 0


def block_offsets(p: int, pattern: tuple[int, int, int], d_first: int, d_rest: int, first_ranks: int) -> Offsets | None:
    """Microbatch 0's slots of a block, or None if two passes of a rank share a residue."""
    residues = [(0, *pattern)]
    for rank in range(1, p):
        d = d_first if rank - 1 < first_ranks else d_rest
        f0, f1, b1, b0 = residues[-1]
        shifted = ((f0 + d) % PERIOD, (f1 - 1) % PERIOD, (b1 + d) % PERIOD, (b0 - 1) % PERIOD)
        if len(set(shifted)) < 4:
            return None
        residues.append(shifted)
    slots = [[0] * 4 for _ in range(p)]
    t = -1
    walk = [(r, 0) for r in range(p)] + [(r, 1) for r in reversed(range(p))]
    walk += [(r, 2) for r in range(p)] + [(r, 3) for r in reversed(range(p))]
    for rank, kind in walk:
        t += 1 + (residues[rank][kind] - t - 1) % PERIOD
        slots[rank][kind] = t
    return tuple(map(tuple, slots))


def _w_slots(f0: int, f1: int, b1: int, b0: int) -> tuple[int, int]:
    used = {f0 % PERIOD, f1 % PERIOD, b1 % PERIOD, b0 % PERIOD}
    w1 = b1 + 1 + next(j for j in range(PERIOD) if (b1 + 1 + j) % PERIOD not in used)
    used.add(w1 % PERIOD)
    w0 = b0 + 1 + next(j for j in range(PERIOD) if (b0 + 1 + j) % PERIOD not in used)
    return w1, w0


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
            for d_rest in range(1, d_first + 1):
                for first_ranks in range(1, max(2, p)):
                    offsets = block_offsets(p, pattern, d_first, d_rest, first_ranks)
                    if offsets is None or offsets in found:
                        continue
                    tight = min(d_first, d_rest if first_ranks < p - 1 else d_first) < 2
                    life = 0
                    for f0, f1, b1, b0 in offsets:
                        life = max(life, max(_w_slots(f0, f1, b1, b0)) - f0)
                    found[offsets] = (tight, -d_first, life)
    return found


def plain_peak(offsets: Offsets, costs: CostModel) -> float:
    """Peak activation memory of the block repeated in the steady state (an upper bound for any m).

    Once every pass of microbatch 0 has run on a rank, the level after slot t counts, for each
    pass, the microbatches that have run it: (t - slot) // 6 + 1.
    """
    p = len(offsets)
    peak = 0.0
    for rank, (f0, f1, b1, b0) in enumerate(offsets):
        w1, w0 = _w_slots(f0, f1, b1, b0)
        early, late = rank // 2, (2 * p - 1 - rank) // 2  # full stages of the V's blocks (v_shape)
        deltas = (
            (f0, costs.mem_f[early]),
            (f1, costs.mem_f[late]),
            (b1, costs.mem_b[late]),
            (b0, costs.mem_b[early]),
            (w1, costs.mem_w[late]),
            (w0, costs.mem_w[early]),
        )
        last = max(w0, w1)
        for t in range(last, last + PERIOD):
            peak = max(peak, sum(delta / 2 * ((t - slot) // PERIOD + 1) for slot, delta in deltas))
    return peak


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
    for block in sorted(blocks, key=lambda b: (blocks[b], b)):
        peak = plain_peak(block, costs)
        levels.setdefault(math.ceil(round(peak / quarter, 6)), []).append((block, peak))
    return [(level * quarter, ranked) for level, ranked in sorted(levels.items())]
