"""v-auto: the best V-placement schedule under --memory-limit L, never worse than a V schedule that fits.

Candidates:

- zb-v, v-half and v-min as their own generators plan them, the plain and squeezed v-half
  and v-min blocks, and PyTorch's ZB-V and DualPipeV orders, whenever their peak fits L;
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

With overlapped F&B pairs (``spec.overlap_f_b`` and all-to-all time in the costs) the pick without
pairs and the fixed candidates above (not every list-scheduler run) are ranked as they run paired,
by makespan (stage span first with post-validation), as pairs are placed (finalists.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..costs import CostModel
from ..ir import Schedule, ScheduleError
from ..pairing import overlap_pairs
from ..placement import Placement, v_shape
from ..registry import ScheduleSpec, pairs_key, register
from ..timing import EPS
from .budget import BUDGET
from .finalists import Candidate, best_paired
from .greedy import Switches, greedy_orders, min_memory_limit
from .result import Result, encoding_of, model_of
from .result import peak as peak_of
from .search import (
    Planner,
    Recipe,
    best,
    check_ceiling,
    checked_limit,
    eval_microbatches,
    greedy_planners,
    plan,
    uniform,
)
from .torch_style import dualpipev_orders
from .v_family import (
    V_SWITCHES,
    block_peak,
    building_block,
    one_f_one_b_peak,
    v_half_offsets,
    v_min_offsets,
    v_spec,
    zb_v,
)
from .v_levels import level_candidates, lowest_block_peak

LADDER_SWITCHES = (Switches(prefer_b=True), Switches(prefer_b=False))


def ladder(placement: Placement, costs: CostModel, m_eval: int, top: float) -> tuple[list[float], tuple[Switches, ...]]:
    """Memory caps from the least limit up to ``top`` and the switch settings to run at each."""
    need = min_memory_limit(placement, costs)
    quarter = min(costs.mem_f) / 4
    fine = int((top - need) / quarter + EPS) + 1
    passes = 3 * m_eval * placement.num_stages
    if fine * len(V_SWITCHES) * passes <= BUDGET.v_auto.ladder_passes:
        switches, step = V_SWITCHES, quarter
    else:
        switches = LADDER_SWITCHES
        step = quarter * math.ceil(fine / max(2, BUDGET.v_auto.ladder_passes // (passes * len(switches))))
    return [need + k * step for k in range(int((top - need) / step + EPS) + 1)], switches


def family_seeds(spec: ScheduleSpec, limit: float | None) -> list[Result]:
    """zb-v (seeded with the PyTorch-style ZB-V order), v-half and v-min as planned by their
    generators, and their blocks; a family whose memory is over ``limit`` is not planned. On large
    settings only the one with the most memory that fits is (more memory, less bubble: the others
    never won there)."""
    fits = float("inf") if limit is None else limit + EPS
    families = [(one_f_one_b_peak(spec), lambda: [best(zb_v(spec))])]
    for offsets, name in ((v_half_offsets, "v-half"), (v_min_offsets, "v-min")):
        families.append((block_peak(spec, offsets), lambda o=offsets, n=name: _block_family(n, spec, o)))
    large = eval_microbatches(spec.microbatches, v_shape(spec.pp)) < spec.microbatches
    seeds: list[Result] = []
    for peak, planned in sorted(families, key=lambda family: -family[0]):
        if peak <= fits:
            try:
                seeds += planned()
            except ScheduleError:
                continue  # a family that cannot plan this setting is no seed
            if large:
                break
    return seeds


def dualpipev(spec: ScheduleSpec, limit: float | None) -> list[Schedule]:
    """PyTorch's DualPipeV order, where it runs (m >= 2pp) and fits ``limit``.

    Its memory peaks in the warm-up or the first steady round, which do not depend on m (each
    steady round frees what it takes), so the order for 2pp microbatches tells whether it fits.
    """
    p, m = spec.pp, spec.microbatches
    if m < 2 * p or (limit is not None and dualpipev_peak(p, spec.cost_model()) > limit + EPS):
        return []
    return [Schedule("v-auto", (v_shape(p),), m, tuple(map(tuple, dualpipev_orders(p, m))))]


def dualpipev_peak(p: int, costs: CostModel) -> float:
    """The DualPipeV order's peak memory on any rank, for 2pp microbatches."""
    m = 2 * p
    encode, model = encoding_of((v_shape(p),), m).encode, model_of((v_shape(p),), m, costs)
    return max(model.peak([encode(x) for x in order]) for order in dualpipev_orders(p, m))


def _block_family(name: str, spec: ScheduleSpec, offsets) -> list[Result]:
    recipe, blocks = building_block(name, spec, offsets)
    return [best(recipe), *blocks]


def _greedy_planners(
    placement: Placement, costs: CostModel, m_eval: int, limit: float | None, below: float = math.inf
) -> list[Planner]:
    """The list scheduler unlimited (if it fits), on the ladder up to ``limit``, and at ``limit`` if off
    the ladder; only where it peaks, or is capped, under ``below``."""
    planners: list[Planner] = []
    top = math.inf if limit is None else limit + EPS
    unlimited = greedy_orders(placement, costs, m_eval, None)
    if unlimited.peak <= top and unlimited.peak < below:
        planners.append(lambda n: greedy_orders(placement, costs, n, None))
    caps, switches = ladder(placement, costs, m_eval, unlimited.peak)
    for cap in caps:
        if cap <= top and cap < below:
            planners += greedy_planners(placement, costs, cap, switches)
    if limit is not None and limit < min(unlimited.peak, below) and all(abs(cap - limit) > EPS for cap in caps):
        planners += greedy_planners(placement, costs, limit, switches)
    return planners


@register(
    "v-auto",
    "V-shape list schedule under --memory-limit (any limit from v-min's to zb-v's)",
    options=("memory_limit", "overlap_f_b"),
)
def generate_v_auto(spec: ScheduleSpec) -> Schedule:
    """With the same costs on every stage and m >= 2pp the list scheduler only runs under the
    least memory a building block needs (above it, it never won on our grid, and it is slow); on
    large settings then only if nothing else fits."""
    v_spec("v-auto", spec)
    placement, limit, m = v_shape(spec.pp), spec.memory_limit, spec.microbatches
    costs = checked_limit("v-auto", spec, placement, limit)
    check_ceiling("v-auto", spec, (placement,))  # before the list scheduler's first run
    m_eval = eval_microbatches(m, placement)
    lean = m >= 2 * spec.pp and uniform(costs)
    below = lowest_block_peak(spec.pp, costs) if lean else math.inf
    skip = lean and m_eval < m
    planners = [] if skip else _greedy_planners(placement, costs, m_eval, limit, below)
    fallback = (lambda: _greedy_planners(placement, costs, m_eval, limit)) if skip else None
    made: list = []  # the fixed candidates, made once: the search's, then (with pairs) the finalists'

    def seeds() -> list[Result | Schedule]:
        if not made:
            made.extend(family_seeds(spec, limit) + level_candidates(spec.pp, m, costs, limit) + dualpipev(spec, limit))
        return made

    picked = plan(Recipe("v-auto", spec, (placement,), limit, planners, (seeds,), fallback=fallback))
    key = pairs_key(spec)
    if key is None:
        return picked
    return _paired_pick(picked, seeds(), costs, limit, key)


def _paired_pick(
    picked: Schedule, seeds: list[Result | Schedule], costs: CostModel, limit: float | None, key: str
) -> Schedule:
    """The best of ``picked`` and the fitting ``seeds`` as they run paired (the pick first among equals)."""
    candidates = [Candidate(picked, lambda: overlap_pairs(picked, costs, key), peak_of(picked, costs), (0,))]
    for index, seed in enumerate(seeds, 1):
        schedule = seed if isinstance(seed, Schedule) else _as_schedule(picked, seed)
        fits = peak_of(schedule, costs) if isinstance(seed, Schedule) else seed.peak
        if limit is None or fits <= limit + EPS:
            candidates.append(Candidate(schedule, lambda s=schedule: overlap_pairs(s, costs, key), fits, (index,)))
    return replace(best_paired(candidates, costs, key)[0], name="v-auto")


def _as_schedule(picked: Schedule, result: Result) -> Schedule:
    return Schedule("v-auto", picked.placements, picked.microbatches, tuple(map(tuple, result.orders)))
