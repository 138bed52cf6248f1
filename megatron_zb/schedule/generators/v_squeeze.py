"""Squeezed V building blocks: the controllable-memory paper's v-half and v-min orders.

The building block gives every pass of rank r a slot: microbatch k's F0, F1, B1, B0 sit at the
block's offsets plus 6k. Repeating it leaves empty slots in the warm-up and the cool-down. The
squeeze moves passes of those two phases into earlier empty slots that their inputs allow,
while no rank's slot-model memory (F +1, W -1 per chunk) rises above the block's peak:

1. with one W per B in the first empty slot after it, squeeze the warm-up and the cool-down
   (the warm-up ends where rank 0 runs its first B0, the cool-down starts after the last
   microbatch's F0), then close the gaps by running every slot order as early as possible
   with unit times;
2. without the Ws (each empty slot then releases one pending W), squeeze the cool-down again
   and close the gaps;
3. put each W, of the late chunk first, in the first empty slot after its B.

The slots sorted give each rank's order, which the simulator runs with the real costs.
"""

from __future__ import annotations

from collections.abc import Callable

from .v_blocks import B0, B1, F0, RISE, chunk_codes, pack, producer

WS = 4  # slot types on a rank: the V's four passes of a microbatch (v_blocks.py), and W

Offsets = Callable[[int, int], list[int]]
Slots = list[list[list[int]]]  # rank -> type -> microbatch -> slot


def squeezed_codes(p: int, m: int, offsets: Offsets) -> list[list[int]]:
    """Per-rank orders of the building block ``offsets`` for m microbatches, squeezed, as codes
    (``timing.Encoding`` of the V; ``v_blocks.as_passes`` reads them)."""
    slots: Slots = [[[base + 6 * k for k in range(m)] for base in offsets(p, r)] for r in range(p)]
    for ranks in slots:
        ranks.append(_ws_after_bs(ranks, split=False)[0])
    _Squeeze(slots, p, m, explicit_w=True).run()
    slots = [ranks[:4] for ranks in _as_early_as_possible(slots, p, m)]
    _Squeeze(slots, p, m, explicit_w=False).run()
    for ranks in slots:
        ranks.append(_ws_after_bs(ranks, split=False)[0])
    slots = [ranks[:4] for ranks in _as_early_as_possible(slots, p, m)]
    orders = [[(t, k) for _, t, k in _items([*ranks, *_ws_after_bs(ranks, split=True)])] for ranks in slots]
    return chunk_codes(p, m, orders)  # the Ws of the late chunk (W1) and the early chunk (W0)


def _ws_after_bs(ranks: list[list[int]], split: bool) -> list[list[int]]:
    """W slots: each empty slot takes a pending W (late chunk first when ``split``)."""
    kind = {slot: t for t in range(4) for slot in ranks[t]}
    end = max(kind)
    out: list[list[int]] = [[], []]
    pending = [0, 0]
    slot = 0
    while slot <= end or any(pending):
        t = kind.get(slot)
        if t is None:
            for which in (0, 1):
                if pending[which]:
                    out[which].append(slot)
                    pending[which] -= 1
                    break
        elif t in (B1, B0):
            pending[t - B1 if split else 0] += 1
        slot += 1
    return out


def _inputs(p: int, r: int, t: int, k: int) -> list[tuple[int, int, int]]:
    """(rank, type, microbatch) that come first: the V's data flow, the chain on the rank, the microbatch before."""
    found = [(r, t - 1, k)] if t else []
    source = producer(p, r, t)
    if source is not None:
        found.append((*source, k))
    if k:
        found.append((r, t, k - 1))
    return found


def _items(ranks: list[list[int]]) -> list[tuple[int, int, int]]:
    """A rank's (slot, type, microbatch) in slot order."""
    return sorted((slot, t, k) for t, row in enumerate(ranks) for k, slot in enumerate(row))


def _as_early_as_possible(slots: Slots, p: int, m: int) -> Slots:
    """Close the gaps: every rank's slot order run as early as possible, one slot per pass (v_blocks.pack)."""
    orders = [_items(ranks) for ranks in slots]
    packed = pack(p, m, [[(t, k) for _, t, k in order] for order in orders])
    assert packed is not None, "every input sits in an earlier slot"
    start: Slots = [[[0] * len(row) for row in ranks] for ranks in slots]
    for r, (order, at) in enumerate(zip(orders, packed, strict=True)):
        for (_, t, k), slot in zip(order, at, strict=True):
            start[r][t][k] = slot
    return start


class _Squeeze:
    """One squeeze pass over all ranks (see the module docstring); edits ``slots`` in place."""

    def __init__(self, slots: Slots, p: int, m: int, explicit_w: bool):
        self.slots, self.p, self.m, self.explicit_w = slots, p, m, explicit_w
        self.types = len(slots[0])
        self.horizon = max(s for ranks in slots for lst in ranks for s in lst) + 1
        self.at = [[None] * self.horizon for _ in range(p)]
        for r in range(p):
            for t in range(self.types):
                for k, s in enumerate(slots[r][t]):
                    self.at[r][s] = (t, k)
        self.level = [[0] * self.horizon for _ in range(p)]
        self.held = [[0] * self.horizon for _ in range(p)]  # pending Ws after each slot (implicit Ws)
        for r in range(p):
            self._replay(r, 0)
        self.peak = max(max(levels) for levels in self.level)

    def run(self) -> None:
        events = sorted(
            (s, r, t, k) for r in range(self.p) for t in range(self.types) for k, s in enumerate(self.slots[r][t])
        )
        phase, done = 0, [set() for _ in range(self.p)]
        for slot, r, t, k in events:
            if phase == 0 and t == B0 and r == 0:
                phase = 1
            fixed = phase == 1 or (phase == 0 and not self.explicit_w)
            if phase == 1 and t == F0 and k == self.m - 1:
                phase = 2
            if not fixed:
                slot = self._move_earlier(r, t, k, slot, done[r])
            done[r].add(slot)

    def _earliest(self, r: int, t: int, k: int) -> int:
        if t == WS:  # the k-th W follows the k-th B of the rank and the W before it
            after_b = sorted(self.slots[r][B1] + self.slots[r][B0])[k] + 1
            return max(after_b, self.slots[r][WS][k - 1] + 1) if k else after_b
        return max((self.slots[q][u][j] + 1 for q, u, j in _inputs(self.p, r, t, k)), default=0)

    def _move_earlier(self, r: int, t: int, k: int, slot: int, taken: set[int]) -> int:
        for target in range(self._earliest(r, t, k), slot):
            if target not in taken and self._try(r, t, k, slot, target):
                return target
        return slot

    def _try(self, r: int, t: int, k: int, slot: int, target: int) -> bool:
        """Move the pass to ``target`` if memory stays within the peak; only the moved range is replayed."""
        at = self.at[r]
        if self.explicit_w:  # the levels between the two slots shift by the pass's own change
            rise, level = RISE[t], self.level[r]
            if rise > 0 and max(level[target:slot]) + rise > self.peak:
                return False
            if rise:
                level[target:slot] = [value + rise for value in level[target:slot]]
            at[slot], at[target] = None, (t, k)
            self.slots[r][t][k] = target
            return True
        at[slot], at[target] = None, (t, k)
        if self._replay(r, target, settle_after=slot):
            self.slots[r][t][k] = target
            return True
        at[slot], at[target] = (t, k), None
        return False

    def _replay(self, r: int, begin: int, settle_after: int | None = None) -> bool:
        """Recompute the memory levels from ``begin``; after a move, give up (unchanged) above the peak.

        After a move (``settle_after`` its old slot) the replay stops where the state meets the
        stored one again past the old slot: from there on nothing changed.
        """
        check = settle_after is not None
        at, level, held = self.at[r], self.level[r], self.held[r]
        mem, pending = (level[begin - 1], held[begin - 1]) if begin else (0, 0)
        new = []
        for i in range(begin, self.horizon):
            item = at[i]
            if item is None:
                if pending and not self.explicit_w:
                    mem, pending = mem - 1, pending - 1
            else:
                mem += RISE[item[0]]
                pending += item[0] in (B1, B0)
            if check:
                if mem > self.peak:
                    return False
                if i >= settle_after and level[i] == mem and held[i] == pending:
                    break
            new.append((mem, pending))
        for offset, (mem, pending) in enumerate(new):
            level[begin + offset], held[begin + offset] = mem, pending
        return True
