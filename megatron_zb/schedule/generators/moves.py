"""Moves: what turns one order into another, for the recipes of search.py.

The moves on whole orders live here; the larger ones have modules of their own: reordering a V
building block's warm-up and cool-down (v_reorder.py), squeezing it (v_squeeze.py),
stretching a steady state to more microbatches (extend.py) and the critical-path moves
(polish.py). Which passes a move may defer is read from the IR: a pass that no other compute
pass waits for (a W) can run later without delaying anything but itself, and a pass that
plays several roles (a fused BW) splits into the kinds that play one each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..actions import spec
from ..costs import CostModel
from ..ir import Pass, PassKind, Schedule, made_pass
from ..registry import ScheduleSpec
from ..timing import COMPUTE, DEFERRABLE, EPS, run
from .result import Result, model_of, timed_codes
from .search import Move, Recipe, plan

Orders = Sequence[Sequence[Pass]]
# a kind playing several roles -> the kinds playing one each, in the order of its roles (BW -> B, W)
SPLIT = {
    kind: tuple(one for role in spec(kind).roles for one in COMPUTE if spec(one).roles == (role,))
    for kind in COMPUTE
    if len(spec(kind).roles) > 1
}


def split_backward(orders: Orders) -> tuple[tuple[Pass, ...], ...]:
    """Each fused pass as its parts at once (BW: B then W): the same times and peak, and the order stays split."""
    split = []
    for order in orders:
        parts: list[Pass] = []
        for p in order:
            kinds = SPLIT.get(p.kind)
            if kinds is None:
                parts.append(p)
            else:
                parts.extend(made_pass(kind, p.stage, p.microbatch, p.pipe) for kind in kinds)
        split.append(tuple(parts))
    return tuple(split)


def split_filled(name: str, setting: ScheduleSpec, plain: Schedule, fill: Move) -> Schedule:
    """``plain`` with its fused passes split (each W right after its B), then moved by ``fill``."""
    split = replace(plain, orders=split_backward(plain.orders))
    seeds, shared = (lambda: [split],), plain.shared
    return plan(Recipe(name, setting, split.placements, None, seeds=seeds, moves=(fill,), shared=shared, refine=False))


def defer(orders: Orders) -> tuple[tuple[Pass, ...], ...]:
    """Every deferrable pass (W) after the rank's other passes, each kind keeping its order."""
    return tuple(
        tuple([p for p in order if p.kind not in DEFERRABLE] + [p for p in order if p.kind in DEFERRABLE])
        for order in orders
    )


Trailing = Callable[[list[int], int, Callable[[int], int]], list[int]]  # (left, last pass, block of a pass)


def oldest_first(left: list[int], last: int, block: Callable[[int], int]) -> list[int]:
    return left


def by_block(left: list[int], last: int, block: Callable[[int], int]) -> list[int]:
    """Grouped by block, the block of the rank's last pass first (ZeRO-3 keeps its weights gathered), then by age."""
    blocks = list(dict.fromkeys(map(block, left)))
    if block(last) in blocks:
        blocks.remove(block(last))
        blocks.insert(0, block(last))
    return [x for b in blocks for x in left if block(x) == b]


def fill_idle(
    result: Result,
    costs: CostModel,
    limit: float | None = None,
    trailing: Trailing = oldest_first,
) -> Result | None:
    """Each rank's deferrable passes (Ws) moved into the idle gaps of the timeline the others leave.

    The other passes keep their order and times. A deferrable pass waits in a queue from its
    place in ``result`` on; before each other pass, the queue's oldest go into the gap before it
    while they fit. Under ``limit`` the oldest also run at once while the rank's memory could
    not take one more forward of a pipe's first block. What is left goes after the rank's last
    pass, in the order ``trailing`` gives.
    """
    placements, m = result.encoding.placements, result.microbatches
    model = model_of(placements, m, costs)
    held = [[x for x in order if model.awaited[x // m]] for order in result.codes]
    clock = run(model, held)
    if clock is None:
        return None
    growth = max(model.delta(result.encoding.code(PassKind.F, 0, 0, pipe)) for pipe in range(len(placements)))
    orders, blocks = [], result.encoding.blocks
    block = lambda x: x // m % blocks  # noqa: E731
    for r, order in enumerate(result.codes):
        queue: deque[int] = deque()
        filled: list[int] = []
        free, level = (clock.start[held[r][0]] if held[r] else 0.0), 0.0
        for x in order:
            if not model.awaited[x // m]:
                queue.append(x)
            else:
                while queue and free + model.duration(queue[0]) <= clock.start[x] + EPS:  # the gap before x
                    free += model.duration(queue[0])
                    level += model.delta(queue[0])
                    filled.append(queue.popleft())
                filled.append(x)
                free, level = clock.ends(x), level + model.delta(x)
            while queue and limit is not None and level + growth > limit:
                level += model.delta(queue[0])
                filled.append(queue.popleft())
        orders.append(filled + (trailing(list(queue), filled[-1], block) if filled else list(queue)))
    return timed_codes(orders, placements, costs, m)
