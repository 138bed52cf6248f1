"""The best orders v-auto can make from V building blocks, level by level of memory.

Blocks (v_blocks.py) are grouped by the peak of their plain repetition in quarter stages. A
level's blocks are *screened*: each is reordered (v_reorder.py) for 2pp microbatches and timed
with the real costs. Many blocks turn into the same orders; the few with the best distinct
screening times are then planned for all microbatches three ways (squeezed, reordered,
reordered with its gaps filled). Every order found is kept as a candidate, and the best of
each peak memory (in quarter stages) is polished (polish.py) without raising that peak.

Small settings (up to pp 6) screen every level, so the candidates do not depend on the limit
and v-auto does not grow with it. Larger ones screen the levels up to one stage of memory below
the highest that fits, from the top down within a pass budget: the best orders come from there
(measured at pp 8 and 16 on the paper's profiles), and a slightly larger limit still sees the
levels a smaller one chose from. Blocks whose reordering breaks are left out. Where
planning all microbatches is slow (``fewer_microbatches``), the finalists are planned for fewer,
only reordered (the squeezed orders never won there), and the best of each peak is extended to
all of them (extend.py).
"""

from __future__ import annotations

import math

from ..costs import CostModel
from ..placement import v_shape
from ..timing import EPS
from .budget import BUDGET
from .extend import extended, fewer_microbatches
from .polish import polish
from .result import Result, timed_codes
from .v_blocks import Offsets, blocks_by_level
from .v_reorder import reordered_variants
from .v_squeeze import squeezed_codes


def level_candidates(p: int, m: int, costs: CostModel, limit: float | None) -> list[Result]:
    """Orders from the building blocks of the levels that fit ``limit``, with the polished best of each peak."""
    fits = float("inf") if limit is None else limit + EPS
    levels = blocks_by_level(p, costs)
    sample = min(m, 2 * p)
    planned_m = fewer_microbatches(m, v_shape(p))  # large settings: plan fewer, then extend (extend.py)
    per_block = 12 * p * p  # passes a screening reorder handles (it repeats 2pp microbatches at least)
    small = per_block * sum(len(blocks) for _, blocks in levels) <= BUDGET.v_auto.small_screen_passes
    budget = BUDGET.v_auto.screen_passes if planned_m == m else BUDGET.v_auto.large_screen_passes
    found: list[Result] = []
    top = None
    for edge, blocks in reversed(levels):
        fitting = [block for block, peak in blocks if peak <= fits]
        if not fitting:
            continue
        top = edge if top is None else top
        if not small:
            fitting = fitting[: max(int(budget // per_block), not found)]
            if not fitting or edge < top - BUDGET.v_auto.screen_window * min(costs.mem_f) - EPS:
                break
            budget -= per_block * len(fitting)
        found += _level(p, planned_m, costs, fitting, sample, fits, stretched=planned_m < m)
    polished = _polished(p, costs, found)
    if planned_m == m:
        return found + polished
    # the best of each peak, polished or not (polishing may leave no steady period to stretch)
    chosen = [*_best_by_peak(found, costs).values(), *polished]
    longer = (extended(result.codes, planned_m, 6, m - planned_m) for result in chosen)
    return [result for result in (timed_codes(codes, v_shape(p), costs, m) for codes in longer if codes) if result]


def lowest_block_peak(p: int, costs: CostModel) -> float:
    """The least peak of a plain building block: below it v-auto has no block to offer."""
    return min(peak for _, peak in blocks_by_level(p, costs)[0][1])


def _level(
    p: int, m: int, costs: CostModel, blocks: list[Offsets], sample: int, fits: float, stretched: bool
) -> list[Result]:
    """The finalists of one level, each planned for m microbatches reordered with and without its gaps
    filled, and squeezed unless they are to be ``stretched`` (extend.py) to more microbatches.

    A reordered block may peak above its plain repetition, so the finalists are chosen per
    peak (in quarter stages) of the screened orders, among the peaks that fit. Where the orders
    are to be stretched a lone block is the finalist unscreened (its screening would not be
    reused); of its orders, those that fit are kept.
    """
    filled: dict[Offsets, Result | None] = {}  # the screening reorders, planned again only for other m
    lone = stretched and len(blocks) == 1
    finalists = blocks if lone else _finalists(p, costs, blocks, sample, fits, filled)
    found = []
    for block in finalists:
        squeezed = () if stretched else (_squeezed(p, m, costs, block),)
        reordered = (
            _reorders(p, m, costs, block, (False,)) + [filled[block]] if m == sample else _reorders(p, m, costs, block)
        )
        for result in (*squeezed, *reordered):
            if result is not None and (not lone or result.peak <= fits):
                found.append(result)
    return found


def _finalists(
    p: int, costs: CostModel, blocks: list[Offsets], sample: int, fits: float, filled: dict[Offsets, Result | None]
) -> list[Offsets]:
    """The blocks with the best distinct screening times, per peak of their screened orders that fits;
    ``filled`` gets each block's screening order."""
    screened: dict[int, list[tuple[tuple[float, float, float], int]]] = {}
    for index, block in enumerate(blocks):
        filled[block] = result = _reorders(p, sample, costs, block, (True,))[0]
        if result is not None and result.peak <= fits:
            screened.setdefault(_bucket(result.peak, costs), []).append((result.score(), index))
    finalists: list[Offsets] = []
    for _, ranked in sorted(screened.items()):
        seen: set[tuple[float, float, float]] = set()
        for score, index in sorted(ranked):
            if len(seen) == BUDGET.v_auto.finalists:
                break
            if score not in seen and blocks[index] not in finalists:
                seen.add(score)
                finalists.append(blocks[index])
    return finalists


def _bucket(peak: float, costs: CostModel) -> int:
    return math.ceil(round(peak / (min(costs.mem_f) / 4), 6))


def _polished(p: int, costs: CostModel, found: list[Result]) -> list[Result]:
    """The best candidate of each peak (in quarter stages), polished under that peak, where that helped."""
    best = _best_by_peak(found, costs).values()
    return [better for result in best if (better := polish(result, v_shape(p), costs, result.peak)) is not result]


def _best_by_peak(found: list[Result], costs: CostModel) -> dict[int, Result]:
    best: dict[int, Result] = {}
    for result in found:
        level = _bucket(result.peak, costs)
        if level not in best or result.score() < best[level].score():
            best[level] = result
    return best


def _squeezed(p: int, m: int, costs: CostModel, block: Offsets) -> Result:
    result = timed_codes(squeezed_codes(p, m, lambda _, r: block[r]), v_shape(p), costs, m)
    assert result is not None, "a squeezed block keeps every input before its pass"
    return result


def _reorders(p: int, m: int, costs: CostModel, block: Offsets, fills=(False, True)) -> list[Result | None]:
    """The block reordered without and with its gaps filled (or as ``fills`` say), timed."""
    found = reordered_variants(p, m, list(block), fills)
    return [None if codes is None else timed_codes(codes, v_shape(p), costs, m) for codes in found]
