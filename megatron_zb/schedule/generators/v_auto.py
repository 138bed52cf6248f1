"""v-auto: the best V-placement schedule under --memory-limit L, never worse than a V schedule that fits.

Candidates:

- zb-v, v-half and v-min as their own generators plan them, the plain and squeezed v-half
  and v-min blocks, and the PyTorch-style ZB-V order, whenever their peak fits L;
- building blocks for memory between v-min's and zb-v's (v_blocks.py), squeezed, as many as
  a budget of scheduled passes allows, spread over the memory levels;
- the list scheduler under a *ladder* of memory caps from the least possible limit up to L,
  a quarter of a stage's activations apart, with every switch setting zb-v tries; when a
  budget of scheduled passes asks for less, with two settings, then with a coarser step;
- the cap L itself when it is not on the ladder.

The ladder and the blocks depend on the setting, not on L, so for L on the ladder a larger
limit only adds candidates: v-auto(L) does not grow with L there (exactly when the candidates
are ranked on all microbatches), and it is never worse than zb-v, v-half or v-min when they fit.
Large settings with the same costs on every stage skip the list scheduler unless nothing else
fits, and take only the first block of the highest block groups that fit L.
"""

from __future__ import annotations

import math

from ..costs import CostModel
from ..ir import Schedule, ScheduleError
from ..placement import Placement, v_shape
from ..registry import ScheduleSpec, register
from .greedy import Switches, greedy_orders, min_memory_limit
from .result import Result
from .search import (
    EPS,
    Planner,
    best_plan,
    check_limit,
    eval_microbatches,
    finish,
    greedy_planners,
    uniform,
    with_seeds,
)
from .timing import timed
from .v_blocks import Offsets, blocks_by_level
from .v_family import (
    V_SWITCHES,
    building_block_plan,
    v_half_offsets,
    v_min_offsets,
    v_spec,
    zb_v_plan,
    zbv_seed,
)
from .v_squeeze import squeezed_orders

LADDER_SWITCHES = (Switches(prefer_b=True), Switches(prefer_b=False))
LADDER_BUDGET = 50_000  # passes the ladder may schedule; bounds planning time at large pp and m
BLOCK_BUDGET = 60_000  # passes of squeezed building blocks


def ladder(placement: Placement, costs: CostModel, m_eval: int, top: float) -> tuple[list[float], tuple[Switches, ...]]:
    """Memory caps from the least limit up to ``top`` and the switch settings to run at each."""
    need = min_memory_limit(placement, costs)
    quarter = min(costs.mem_f) / 4
    fine = int((top - need) / quarter + EPS) + 1
    passes = 3 * m_eval * placement.num_stages
    if fine * len(V_SWITCHES) * passes <= LADDER_BUDGET:
        switches, step = V_SWITCHES, quarter
    else:
        switches = LADDER_SWITCHES
        step = quarter * math.ceil(fine / max(2, LADDER_BUDGET // (passes * len(switches))))
    return [need + k * step for k in range(int((top - need) / step + EPS) + 1)], switches


def family_seeds(spec: ScheduleSpec) -> list[Schedule | Result]:
    """zb-v, v-half and v-min as planned by their generators, their blocks and the PyTorch-style ZB-V order."""
    seeds: list[Schedule | Result] = [zbv_seed("v-auto", spec)]
    try:
        seeds.append(zb_v_plan(spec))
    except ScheduleError:
        pass
    for offsets, name in ((v_half_offsets, "v-half"), (v_min_offsets, "v-min")):
        try:
            best, blocks = building_block_plan(name, spec, offsets)
        except ScheduleError:
            continue
        seeds += [best, *blocks]
    return seeds


def _squeezed(placement: Placement, costs: CostModel, block: Offsets, m: int) -> Result:
    result = timed(squeezed_orders(placement.pp, m, lambda p, r: block[r]), placement, costs, m)
    if result is None:
        raise ScheduleError("a squeezed building block deadlocked")
    return result


def block_planners(spec: ScheduleSpec, placement: Placement, costs: CostModel, limit: float | None) -> list[Planner]:
    """The best block of each memory level that fits ``limit``, picked on at most 2pp microbatches.

    The pick per level does not depend on the limit: a larger limit only adds levels. Large
    settings (ranked on a sample of the microbatches anyway) take only the first block of the
    highest levels that fit.
    """
    fits = limit + EPS if limit is not None else float("inf")
    levels = [blocks for _, blocks in blocks_by_level(spec.pp, costs)]
    sample = min(spec.microbatches, 2 * spec.pp)
    passes = 3 * sample * placement.num_stages
    if eval_microbatches(spec.microbatches, placement) < spec.microbatches:
        fitting = [[block for block, peak in blocks if peak <= fits] for blocks in levels]
        picks = [blocks[0] for blocks in [b for b in fitting if b][-max(1, BLOCK_BUDGET // passes // 4) :]]
    else:
        per_level = max(1, min(4, BLOCK_BUDGET // (passes * max(1, len(levels)))))
        picks = []
        for blocks in levels:
            if min(peak for _, peak in blocks) > fits:
                break
            best, peak = min((_squeezed(placement, costs, b, sample).score(), (b, pk)) for b, pk in blocks[:per_level])[
                1
            ]
            if peak <= fits:
                picks.append(best)
    return [(lambda n, b=block: _squeezed(placement, costs, b, n)) for block in picks]


def _greedy_planners(placement: Placement, costs: CostModel, m_eval: int, limit: float | None) -> list[Planner]:
    """The list scheduler unlimited (if it fits), on the ladder up to ``limit``, and at ``limit`` if off the ladder."""
    planners: list[Planner] = []
    unlimited = greedy_orders(placement, costs, m_eval, None)
    if limit is None or unlimited.peak <= limit + EPS:
        planners.append(lambda n: greedy_orders(placement, costs, n, None))
    caps, switches = ladder(placement, costs, m_eval, unlimited.peak)
    for cap in caps:
        if limit is None or cap <= limit + EPS:
            planners += greedy_planners(placement, costs, cap, switches)
    if limit is not None and limit < unlimited.peak and all(abs(cap - limit) > EPS for cap in caps):
        planners += greedy_planners(placement, costs, limit, switches)
    return planners


@register("v-auto", "V-shape list schedule under --memory-limit (any limit from v-min's to zb-v's)")
def generate_v_auto(spec: ScheduleSpec) -> Schedule:
    """On large settings with the same costs on every stage the list scheduler only runs when no
    other candidate fits (it never won there on our grid, and it is the slow part)."""
    v_spec("v-auto", spec)
    placement, limit, m = v_shape(spec.pp), spec.memory_limit, spec.microbatches
    costs = check_limit("v-auto", spec, placement, limit)
    m_eval = eval_microbatches(m, placement)
    lean = m_eval < m and uniform(costs)
    planners = block_planners(spec, placement, costs, limit)
    if not lean:
        planners += _greedy_planners(placement, costs, m_eval, limit)
    best = with_seeds(best_plan(planners, placement, costs, m, limit), family_seeds(spec), placement, costs, limit)
    if best is None and lean:
        best = best_plan(_greedy_planners(placement, costs, m_eval, limit), placement, costs, m, limit)
    if best is None:
        raise ScheduleError(f"v-auto: no heuristic could plan pp={spec.pp}, microbatches={m}")
    return finish("v-auto", spec, placement, costs, limit, best.orders)
