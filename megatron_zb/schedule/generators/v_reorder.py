"""V building blocks repeated, packed and reordered: the controllable-memory paper's framework.

The squeeze (v_squeeze.py) moves single passes into earlier empty slots. This reworks the two
phases as a whole instead, in the same slot model (unit passes; memory F +1, W -1 per chunk):

1. repeat the block for max(m, 2pp) microbatches and *pack* it: every rank keeps its order,
   each pass in the first slot after its rank's previous pass and its input;
2. rewrite each rank's *warm-up* (the passes before its first B0) as a run of early forwards,
   then early and late forwards alternating (rank i runs at most i+1 late ones, and no more
   forwards than the packed block's peak holds), then rounds of B1, W, one forward; pack;
3. drop the extra microbatches and pack;
4. rewrite the *cool-down*: each rank's last B0s (half the peak) and last B1s (at most i+1)
   move to fixed slots two apart after rank 0's last late forward (the B0s towards the end,
   the B1s right after it), the Ws they free are taken out and put back into the first empty
   slots after the rank's last remaining W; pack;
5. label each W with the oldest B that has none (the slot model does not tell which chunk's W
   runs: ``v_blocks.item_codes``).

A block whose rewrite would break a dependency, need more memory than its packed peak or put
two passes in one slot is given up (None); v-auto keeps the squeezed block for it.
"""

from __future__ import annotations

from .v_blocks import B0, B1, F0, F1, RISE, W0, W1, Quad, item_codes, pack, producer, repeated

Item = tuple[int, int]  # (type, microbatch)
Orders = list[list[Item]]


def reordered_variants(
    p: int, m: int, offsets: list[Quad], fills: tuple[bool, ...] = (False, True)
) -> list[list[list[int]] | None]:
    """Per-rank orders of the block ``offsets`` (microbatch 0's slots of F0, F1, B1, B0 per rank) as codes
    (``timing.Encoding`` of the V), for each of ``fills`` (whether its gaps are filled); steps 1-4 run once."""
    done = _steps(p, m, offsets)
    if done is None:
        return [None] * len(fills)
    orders, slots, bound = done
    found = []
    for fill in fills:
        final = _fill_gaps(orders, slots, p, m, _peak(orders)) if fill else orders
        found.append(None if _peak(final) > bound else item_codes(p, m, final))
    return found


def _steps(p: int, m: int, offsets: list[Quad]) -> tuple[Orders, list[list[int]], int] | None:
    """Steps 1-4: the orders, their slots and the peak they may keep; None if the block is given up."""
    reps = max(m, 2 * p)
    orders = repeated(offsets, reps)
    bound = _peak(orders)
    if bound > 2 * p or (not _flows(p, offsets) and pack(p, reps, orders) is None):
        return None
    orders = [_warm_up(order, i, p, bound, reps) for i, order in enumerate(orders)]
    slots = pack(p, reps, orders)
    if slots is None or _peak(orders) > bound:
        return None
    if m < reps:
        orders = [_drop_extra_ws([(t, k) for t, k in order if k < m or t >= W1], m) for order in orders]
        slots, bound = pack(p, m, orders), _peak(orders)
        if slots is None:
            return None
    orders = _cool_down(orders, slots, p, m, _peak(orders))
    slots = None if orders is None else pack(p, m, orders)
    return None if slots is None else (orders, slots, bound)


def _flows(p: int, offsets: list[Quad]) -> bool:
    """Whether every pass of the block comes after its input (each W after its B by construction): then
    the repeated block packs (the pass in the earliest slot not placed can always run), unpacked."""
    inputs = ((producer(p, r, t), slot) for r, slots in enumerate(offsets) for t, slot in enumerate(slots))
    return all(source is None or offsets[source[0]][source[1]] < slot for source, slot in inputs)


def _peak(orders: Orders) -> int:
    peak = 0
    for order in orders:
        level = 0
        for t, _ in order:
            level += RISE[t]
            peak = max(peak, level)
    return peak


def _warm_up(order: list[Item], i: int, p: int, peak: int, reps: int) -> list[Item]:
    """Rank i's passes before its first B0, rewritten (step 2 of the module docstring)."""
    end = next(j for j, (t, _) in enumerate(order) if t == B0)
    have = [0] * 6
    for t, _ in order[:end]:
        have[t] += 1
    late = min(i + 1, peak // 2, reps)
    cap = [min(peak - late, reps, have[F0]), min(late, have[F1])]
    used = [0] * 6
    out: list[Item] = []

    def put(t: int) -> None:
        out.append((t, used[t]))
        used[t] += 1

    for _ in range(min(2 * (p - 1 - i), cap[0])):
        put(F0)
    for _ in range(i + 1):
        if used[F0] < cap[0]:
            put(F0)
        if used[F1] < cap[1]:
            put(F1)
    while any(used[t] < have[t] for t in range(6)):
        for t in (B1, W1):
            if used[t] < have[t]:
                put(t)
        if used[F1] < have[F1]:
            put(F1)
        elif used[F0] < have[F0]:
            put(F0)
    return out + order[end:]


def _drop_extra_ws(order: list[Item], m: int) -> list[Item]:
    kept, seen = [], [0] * 6
    for t, k in order:
        seen[t] += 1
        if t < W1 or seen[t] <= m:
            kept.append((t, k))
    return kept


def _cool_down(orders: Orders, slots: list[list[int]], p: int, m: int, peak: int) -> Orders | None:
    """Step 4 of the module docstring; None if two passes would share a slot."""
    n_b0 = min((peak + 1) // 2, m)
    n_b1 = min(peak - n_b0, m)
    start = max(s for (t, _), s in zip(orders[0], slots[0], strict=True) if t == F1)
    out = []
    for i, (order, at) in enumerate(zip(orders, slots, strict=True)):
        cells = dict(zip(at, order, strict=True))
        moved = [0] * 6
        for s in sorted(cells, reverse=True):
            t = cells[s][0]
            if (t == B1 and moved[B1] < min(i + 1, n_b1)) or (t == B0 and moved[B0] < n_b0):
                del cells[s]
                moved[t] += 1
        for s in sorted(cells, reverse=True):
            if moved[W1] >= moved[B1] and moved[W0] >= moved[B0] and moved[W1] + moved[W0] >= peak:
                break
            if cells[s][0] >= W1:
                moved[cells.pop(s)[0]] += 1
        targets = [(start - i + 2 * p - 2 * k, B0) for k in range(moved[B0])]
        targets += [(start + 1 + i - 2 * k, B1) for k in range(moved[B1])]
        for s, t in targets:
            if s in cells:
                return None
            cells[s] = (t, -1)
        out.append(_with_ws(cells))
    return [_numbered(order) for order in out]


def _with_ws(cells: dict[int, Item]) -> list[Item]:
    """The rank's order with its missing Ws back: each empty slot after its last W takes one whose
    B has run by then (the late chunk's first)."""
    last_w = max((s for s, (t, _) in cells.items() if t >= W1), default=-1)
    total = [0] * 6
    for t, _ in cells.values():
        total[t] += 1
    missing = [total[B1] - total[W1], total[B0] - total[W0]]
    owed = [0, 0]  # Bs run so far without a W
    slot, end = 0, max(cells)
    while any(missing):
        item = cells.get(slot)
        if item is not None:
            t = item[0]
            if t in (B1, B0):
                owed[t - B1] += 1
            elif t >= W1:
                owed[t - W1] -= 1
        elif slot > last_w:
            for which in (0, 1):
                if missing[which] and (owed[which] > 0 or slot > end):
                    cells[slot] = (W1 + which, -1)
                    missing[which] -= 1
                    owed[which] -= 1
                    break
        slot += 1
    return [cells[s] for s in sorted(cells)]


def _fill_gaps(orders: Orders, slots: list[list[int]], p: int, m: int, peak: int) -> Orders:
    """Fill each empty slot, earliest first, with the rank's next pass of some type that can move
    there: its input in an earlier slot, and no level between the two slots above ``peak``."""
    end = max(max(at) for at in slots) + 1
    grid: list[list[Item | None]] = [[None] * end for _ in range(p)]
    where = [[[end] * m for _ in range(6)] for _ in range(p)]  # rank -> type -> k -> slot
    for r, (order, at) in enumerate(zip(orders, slots, strict=True)):
        for (t, k), s in zip(order, at, strict=True):
            grid[r][s] = (t, k)
            where[r][t][k] = s
    last = [at[-1] for at in slots]
    level = [0] * p
    for j in range(end):
        for r in range(p):
            cells = grid[r]
            if cells[j] is None and j < last[r]:
                _fill_one(cells, where, r, j, p, peak - level[r], last[r])
            if cells[j] is not None:
                level[r] += RISE[cells[j][0]]
    return [[cell for cell in cells if cell is not None] for cells in grid]


def _fill_one(cells: list[Item | None], where: list, r: int, j: int, p: int, room: int, last: int) -> None:
    """Move into empty slot j of rank r the first pass of a type that may go there (see ``_fill_gaps``)."""
    tried = 0  # a bit per type
    rise = top = 0
    for s in range(j + 1, last + 1):
        item = cells[s]
        if item is None:
            continue
        t, k = item
        below = top  # the highest level between j and s, relative to the level at j
        rise += RISE[t]
        if rise > top:
            top = rise
        if tried >> t & 1:
            continue
        tried |= 1 << t
        needs = producer(p, r, t)
        if (RISE[t] <= 0 or below < room) and (needs is None or where[needs[0]][needs[1]][k] < j):
            cells[j], cells[s] = item, None
            where[r][t][k] = j
            return
        if tried == 0b111111:
            return


def _numbered(order: list[Item]) -> list[Item]:
    """Microbatches by order of appearance per type (each type keeps its microbatches in order)."""
    seen = [0] * 6
    out = []
    for t, _ in order:
        out.append((t, seen[t]))
        seen[t] += 1
    return out
