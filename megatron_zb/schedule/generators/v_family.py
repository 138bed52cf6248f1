"""The V-shape family (controllable-memory paper): zb-v, v-half and v-min (v-auto: v_auto.py).

All run on the V placement (rank r holds blocks r and 2pp-1-r, each half a stage), so every
rank holds one early and one late block and memory is balanced across ranks.

- v-min and v-half repeat a building block every 6 slots: the offsets of F0, F1, B1, B0 of
  rank i come from the paper (below); each W goes in the first free slot after its B. The
  block's lifespan bounds peak memory at about a third (v-min) or half (v-half) of 1f1b's.
  Sorting the slots gives the per-rank order; running it as soon as possible squeezes out
  the empty slots. The block squeezed in warm-up and cool-down (v_squeeze.py) and the list
  scheduler, capped at the block's peak, join as candidates; the best is kept.
- zb-v plans at 1f1b's peak memory with the round heuristic of the ZB paper's ZB-V
  (zbv_rounds.py) and the list scheduler, seeded with the PyTorch-style ZB-V order and, with
  unequal stages, the rounds planned at the median stage costs: about zero bubble for
  m >= 2pp. The pick dominates that median plan on stage span and makespan, and its trailing
  Ws go into idle gaps (v_tail.py). On large settings the rounds and the seed are planned for
  fewer microbatches and their steady state stretched (extend.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..costs import CostModel
from ..ir import Schedule, ScheduleError
from ..placement import v_shape
from ..registry import ScheduleSpec, register
from ..simulate import memory_levels
from .extend import stretched
from .greedy import ALL_SWITCHES
from .result import Result, timed_codes
from .search import Move, Planner, Recipe, check_ceiling, eval_microbatches, plan, searched
from .torch_style import zbv_codes
from .v_blocks import PERIOD, as_passes, chunk_codes, plain_peak, repeated
from .v_squeeze import squeezed_codes
from .v_tail import sunk_tail
from .zbv_rounds import V_ROUND_SWITCHES, RoundRuns, flat

V_SWITCHES = tuple(s for s in ALL_SWITCHES if s.depth_first)  # breadth-first never won on the V


def v_min_offsets(p: int, i: int) -> list[int]:
    delta = 2 if p % 3 == 0 else 0
    return [i, 2 * p - i - 1, 2 * p + delta + i, 4 * p + delta - i - 1]


def v_half_offsets(p: int, i: int) -> list[int]:
    delta = 3 if p % 2 == 0 else 0
    return [2 * i, 3 * p - i - 2, 3 * p + delta + 2 * i - 1, 6 * p + delta - i - 2]


def block_codes(p: int, m: int, offsets) -> list[list[int]]:
    """Repeat the building block for every microbatch and read off each rank's order, as codes
    (``timing.Encoding`` of the V; ``v_blocks.as_passes`` reads them)."""
    for rank in range(p):
        if len({slot % PERIOD for slot in offsets(p, rank)}) != 4:
            raise ScheduleError(f"building block offsets {offsets(p, rank)} collide for pp={p}, rank {rank}")
    return chunk_codes(p, m, repeated([tuple(offsets(p, rank)) for rank in range(p)], m))


def v_spec(name: str, spec: ScheduleSpec) -> None:
    if spec.chunks not in (None, 2):
        raise ScheduleError(f"{name} runs two chunks per rank (the V), got --chunks {spec.chunks}")


def block_schedule(name: str, spec: ScheduleSpec, offsets) -> Schedule:
    orders = as_passes(spec.pp, spec.microbatches, block_codes(spec.pp, spec.microbatches, offsets))
    return Schedule(name, (v_shape(spec.pp),), spec.microbatches, tuple(map(tuple, orders)))


def block_peak(spec: ScheduleSpec, offsets) -> float:
    """Peak memory of the plain building block: the limit v-half and v-min keep.

    On large settings (at least 2pp microbatches, more than one lives on a rank) that is the
    steady state's peak, found without repeating the block (v_blocks.plain_peak).
    """
    if eval_microbatches(spec.microbatches, v_shape(spec.pp)) < spec.microbatches:
        return plain_peak(tuple(tuple(offsets(spec.pp, rank)) for rank in range(spec.pp)), spec.cost_model())
    block = block_schedule("block", spec, offsets)
    return max(max((0.0, *levels)) for levels in memory_levels(block, spec.cost_model()))


def block_results(spec: ScheduleSpec, offsets) -> list[Result]:
    """The plain building block and the squeezed one, timed (the squeezed one may peak above the block)."""
    p, m, costs = spec.pp, spec.microbatches, spec.cost_model()
    found = []
    for orders in (block_codes, squeezed_codes):
        result = stretched(lambda n, make=orders: make(p, n, offsets), v_shape(p), costs, m)
        if result is not None:
            found.append(result)
    return found


def building_block(name: str, spec: ScheduleSpec, offsets) -> tuple[Recipe, list[Result]]:
    """Within the block's peak: the plain and squeezed blocks, and the list scheduler (and the blocks, for v-auto)."""
    v_spec(name, spec)
    candidates = block_results(spec, offsets)
    limit = block_peak(spec, offsets)
    return searched(name, spec, v_shape(spec.pp), limit, candidates, switches=V_SWITCHES, lean=True), candidates


def one_f_one_b_peak(spec: ScheduleSpec) -> float:
    """1f1b's peak: rank r holds min(pp-r, m) microbatches of its stage."""
    mem_f = spec.cost_model().mem_f
    return max(min(spec.pp - r, spec.microbatches) * mem_f[r] for r in range(spec.pp))


def v_round_planners(costs: CostModel, limit: float | None) -> list[Planner]:
    """The ZB-V rounds with each switch setting (those that plan alike run once), stretched on large settings."""
    runs = RoundRuns(costs, limit)
    placement = v_shape(costs.pp)
    return [(lambda m, s=setting: stretched(lambda n: runs(n, s), placement, costs, m)) for setting in V_ROUND_SWITCHES]


def flat_round_result(costs: CostModel, limit: float | None, m: int) -> Result | None:
    """The ZB-V rounds planned with every stage at the median costs (zbv_rounds.py), the switch setting whose
    plan is best by that plan's own timing, timed on the true costs. None when the stages' times are equal
    (the rounds then plan the same), when no setting plans, and on large settings: there the warm-up and
    the cool-down it improves weigh little, and it would add a tenth to zb-v's planning time."""
    planned, placement = flat(costs), v_shape(costs.pp)
    same = all(getattr(planned, name) == getattr(costs, name) for name in ("t_f", "t_b", "t_w"))
    if same or eval_microbatches(m, placement) < m:
        return None
    runs, chosen = RoundRuns(planned, limit), None
    for setting in V_ROUND_SWITCHES:
        try:
            score = runs(m, setting).score()
        except ScheduleError:
            continue
        if chosen is None or score < chosen[0]:
            chosen = (score, setting)
    if chosen is None:
        return None
    return timed_codes(runs(m, chosen[1]).codes, placement, costs, m)


def dominating(anchor: Result | None) -> Callable[[Result], tuple]:
    """A rank putting the candidates no worse than ``anchor`` on both stage span and makespan first, each
    group by ``Result.score``: the pick is then never worse than the anchor on either (it ranks itself)."""
    if anchor is None:
        return Result.score
    span, makespan, _ = anchor.score()
    return lambda result: (result.score()[0] > span or result.score()[1] > makespan, *result.score())


def sunk(result: Result | None, costs: CostModel) -> Result | None:
    """``result`` with its trailing Ws in idle gaps (v_tail.py) where that shortens it, else itself."""
    moved = None if result is None else sunk_tail(result, costs)
    return result if moved is None or moved.score() >= result.score() else moved


def zb_v(spec: ScheduleSpec) -> Recipe:
    """The ZB-V rounds and the list scheduler at 1f1b's peak, seeded with the PyTorch-style ZB-V order.

    Where the rounds planned at the median costs are a seed (the reference planner's plan, in our
    code, on settings planned in full), the pick dominates that plan on stage span and makespan:
    the shortest stage span alone may end later. The seeds, then the pick, have their trailing Ws
    moved into idle gaps (v_tail.py), which shortens the ranks that end last.
    """
    v_spec("zb-v", spec)
    limit, p, costs = one_f_one_b_peak(spec), spec.pp, spec.cost_model()
    planners = v_round_planners(costs, limit)
    seed = stretched(lambda n: zbv_codes(p, n), v_shape(p), costs, spec.microbatches)
    anchor = flat_round_result(costs, limit, spec.microbatches)
    seeds = [found for found in (seed, anchor) if found is not None]
    if anchor is not None:  # ranked against the plain anchor, sunk: they may then dominate it
        seeds = [sunk(found, costs) for found in seeds]
    recipe = searched("zb-v", spec, v_shape(p), limit, seeds, planners, V_SWITCHES, lean=True)
    return replace(recipe, rank=dominating(anchor), moves=(Move(lambda result: sunk_tail(result, costs)),))


@register("v-min", "V-shape building block at about a third of 1f1b's memory (pp/3+1 stages)")
def generate_v_min(spec: ScheduleSpec) -> Schedule:
    check_ceiling("v-min", spec, (v_shape(spec.pp),))  # before the blocks are built and timed
    return plan(building_block("v-min", spec, v_min_offsets)[0])


@register("v-half", "V-shape building block at about half of 1f1b's memory (pp/2+1 stages)")
def generate_v_half(spec: ScheduleSpec) -> Schedule:
    check_ceiling("v-half", spec, (v_shape(spec.pp),))
    return plan(building_block("v-half", spec, v_half_offsets)[0])


@register("zb-v", "zero bubble V: 1f1b's memory, about zero bubble for m >= 2pp, twice the PP messages")
def generate_zb_v(spec: ScheduleSpec) -> Schedule:
    check_ceiling("zb-v", spec, (v_shape(spec.pp),))
    return plan(zb_v(spec))
