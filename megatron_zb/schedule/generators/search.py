"""The one search driver: a schedule family is a ``Recipe``, and ``plan`` keeps its best candidate.

A recipe names the placements and the memory limit, and where candidates come from:
*planners*, heuristics that plan any number of microbatches (the list scheduler with one
switch setting, a round heuristic), and *seeds*, fixed orders (the handmade and PyTorch-style
schedules, the V building blocks, whole other families for ``auto``). Planners are ranked on a
sample of the microbatches when planning all of them for every candidate would be slow; the
best ones are then planned for all (``budget.py``). Seeds are timed on all microbatches and
kept when they fit the memory limit, so the result is never worse than any of them. The best
candidate then goes through the recipe's *moves* (moves.py), each kept when it is better, or
always when the move cannot make it slower. Candidates are ranked by stage span, then
makespan, then peak memory, unless the recipe ranks otherwise (``auto``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ..costs import CostModel
from ..ir import Pass, PassKind, Schedule, ScheduleError
from ..placement import Placement
from ..registry import ScheduleSpec
from ..timing import EPS
from .budget import BUDGET
from .greedy import ALL_SWITCHES, Switches, check_memory_costs, greedy_orders, min_memory_limit, pruned_above
from .result import Result, remember, timed_schedule

Planner = Callable[[int], Result]  # plans m microbatches; raises ScheduleError when it cannot
Seeds = Callable[[], Iterable["Result | Schedule"]]  # fixed candidates, made when the search gets to them


@dataclass(frozen=True)
class Move:
    apply: Callable[[Result], Result | None]
    always: bool = False  # keep its result even when not better (the move cannot make the order slower)


@dataclass(frozen=True)
class Recipe:
    name: str
    spec: ScheduleSpec
    placements: tuple[Placement, ...]
    limit: float | None  # candidates above it are passed over
    planners: Sequence[Planner] = ()
    seeds: Sequence[Seeds] = ()
    moves: Sequence[Move] = ()
    fallback: Callable[[], Sequence[Planner]] | None = None  # made and planned only when no other candidate fits
    shared: tuple = ()  # Schedule.shared
    rank: Callable[[Result], tuple] = Result.score
    title: Callable[[Result], str] | None = None  # the schedule's name (default: the recipe's)
    refusal: Callable[[], str] | None = None  # the error when nothing fits (default: no heuristic could plan)
    refine: bool = True  # --refine-seconds gives the result to the solver


def best(recipe: Recipe) -> Result:
    """The recipe's best candidate after its moves; raises ScheduleError when none fits."""
    found = _best_plan(recipe, recipe.planners)
    for make in recipe.seeds:
        for seed in make():
            result = seed if isinstance(seed, Result) else timed_schedule(seed, recipe.spec.cost_model(), recipe.limit)
            found = _better(recipe, found, result)
    if found is None and recipe.fallback is not None:
        found = _best_plan(recipe, recipe.fallback())
    if found is None:
        spec = recipe.spec
        message = f"{recipe.name}: no heuristic could plan pp={spec.pp}, microbatches={spec.microbatches}"
        raise ScheduleError(recipe.refusal() if recipe.refusal else message)
    for move in recipe.moves:
        moved = move.apply(found)
        if moved is not None and (move.always or recipe.rank(moved) < recipe.rank(found)):
            found = moved
    return found


@dataclass(frozen=True)
class Ceiling:
    """What a caller comparing whole schedules (``auto``) still needs: a makespan (or with ``span`` a
    stage span) at most ``value``. A recipe whose placement cannot get there is refused unplanned.

    Only the outermost ``plan`` of a build is checked, and its recipe's placement is the schedule's:
    the recipes planned inside it (seeds, other families) are not whole schedules for the caller."""

    value: float
    span: bool = False
    memory: float | None = None  # the caller's memory limit: a plan over it is refused (``check_memory_floor``)


_CEILING: ContextVar[Ceiling | None] = ContextVar("ceiling", default=None)


@contextmanager
def ceiling(limit: Ceiling | None) -> Iterator[None]:
    """Within the block the outermost ``plan`` raises ``Unreachable`` if its bound is over ``limit``."""
    token = _CEILING.set(limit)
    try:
        yield
    finally:
        _CEILING.reset(token)


class Unreachable(ScheduleError):
    """The recipe's placement cannot meet the caller's ceiling (``time_bound``): it was not planned."""


def time_bound(costs: CostModel, placement: Placement, microbatches: int, span: bool = False) -> float:
    """No schedule on the placement has a shorter makespan (``span``: stage span).

    A rank's passes take its work; with the makespan, its first pass, an F, also waits for the
    Fs of every block before its first (the first pass of all is an F of block 0), and T_comm
    per rank crossing between them.
    """
    kinds = (PassKind.F, PassKind.B, PassKind.W)
    work, first = [0.0] * placement.pp, [-1.0] * placement.pp
    reach = 0.0  # when block b's first F can start, after block 0's
    for block in range(placement.num_stages):
        rank = placement.rank_of(block)
        if first[rank] < 0:
            first[rank] = reach
        work[rank] += microbatches * sum(costs.duration(Pass(kind, block, 0), placement) for kind in kinds)
        reach += costs.duration(Pass(PassKind.F, block, 0), placement)
        if block + 1 < placement.num_stages and placement.rank_of(block + 1) != rank:
            reach += costs.t_comm
    return max(w + (0.0 if span else f) for w, f in zip(work, first, strict=True))


def check_ceiling(name: str, spec: ScheduleSpec, placements: tuple[Placement, ...]) -> None:
    """Raise ``Unreachable`` when a ``ceiling`` is set and the placement cannot meet it (before any work)."""
    limit = _CEILING.get()
    if limit is None or len(placements) != 1:
        return
    bound = time_bound(spec.cost_model(), placements[0], spec.microbatches, limit.span)
    if bound > limit.value + 1e-6 * abs(limit.value) + 1e-6:
        what = "stage span" if limit.span else "makespan"
        raise Unreachable(f"{name}: no {what} under {limit.value:g} on this placement (at least {bound:g})")


def check_memory_floor(name: str, floor: float) -> None:
    """Raise ``Unreachable`` when a ``ceiling`` with a memory limit is set and ``floor``, memory every plan of
    the recipe holds at some point, is over it (before the plan is made)."""
    limit = _CEILING.get()
    if limit is not None and limit.memory is not None and floor > limit.memory + EPS:
        raise Unreachable(f"{name} holds at least {floor:g} at once, over the memory limit {limit.memory:g}")


def plan(recipe: Recipe) -> Schedule:
    """``best`` as a schedule, refined by the solver if asked (refused first if a ``ceiling`` is out of reach)."""
    check_ceiling(recipe.name, recipe.spec, recipe.placements)
    with ceiling(None):  # the recipes it plans inside are not whole schedules for the caller
        found = best(recipe)
    spec, orders = recipe.spec, tuple(map(tuple, found.orders))
    name = recipe.title(found) if recipe.title else recipe.name
    schedule = Schedule(name, found.encoding.placements, spec.microbatches, orders, recipe.shared)
    if recipe.refine and spec.refine_seconds > 0:
        from ..refine import refine

        return refine(schedule, spec.cost_model(), recipe.limit, spec.refine_seconds)
    remember(orders, spec.cost_model(), found)
    return schedule


def _better(recipe: Recipe, found: Result | None, result: Result | None) -> Result | None:
    if result is None or (recipe.limit is not None and result.peak > recipe.limit + EPS):
        return found
    return result if found is None or recipe.rank(result) < recipe.rank(found) else found


def _best_plan(recipe: Recipe, planners: Sequence[Planner]) -> Result | None:
    """The best planner's orders for all microbatches, planners ranked on a sample where that is slow."""
    if not planners:
        return None
    placement, m = recipe.placements[0], recipe.spec.microbatches
    floor = round(m * lower_bound(recipe.spec.cost_model(), placement), 9)
    m_eval = eval_microbatches(m, placement)
    ranked: list[tuple[tuple, int]] = []
    found: Result | None = None
    for index, planner in enumerate(planners):
        if m_eval == m:
            bound = _span_to_beat(recipe, found)
        else:  # a sample run is only planned for all if its score is among the ``confirm`` lowest
            scores = sorted({score for score, _ in ranked})
            bound = scores[BUDGET.search.confirm - 1][0] if len(scores) >= BUDGET.search.confirm else None
        try:
            with pruned_above(bound):
                result = planner(m_eval)
        except ScheduleError:
            continue
        if m_eval == m:
            found = _better(recipe, found, result)
            if found is not None and found.score()[0] <= floor:
                return found
        else:
            ranked.append((result.score(), index))
    confirmed: set[tuple] = set()
    for ranked_score, index in sorted(ranked):
        if len(confirmed) == BUDGET.search.confirm:
            break
        if ranked_score in confirmed:
            continue  # ties on the sample are usually the same orders: plan one of them
        confirmed.add(ranked_score)
        try:
            with pruned_above(_span_to_beat(recipe, found)):
                found = _better(recipe, found, planners[index](m))
        except ScheduleError:
            continue
    return found


def _span_to_beat(recipe: Recipe, found: Result | None) -> float | None:
    """The stage span a planner must not exceed to replace ``found`` (None: any may, or the recipe ranks
    otherwise): with the stage span as the first key, a longer one loses whatever else it is."""
    if found is None or recipe.rank is not Result.score:
        return None
    return found.stage_span


def lower_bound(costs: CostModel, placement: Placement) -> float:
    """No stage span is shorter than the busiest rank's work per microbatch."""
    work = [0.0] * placement.pp
    for block, (rank, _) in enumerate(placement.blocks):
        work[rank] += costs.work_per_microbatch(placement.full_stage(block)) / placement.chunks
    return max(work)


def eval_microbatches(m: int, placement: Placement) -> int:
    """How many microbatches planners are ranked on: all of them unless that is slow."""
    if 3 * m * placement.num_stages <= BUDGET.search.eval_passes:
        return m
    return min(m, max(2 * placement.pp, BUDGET.search.eval_passes // (3 * placement.num_stages)))


def large(spec: ScheduleSpec, placement: Placement) -> bool:
    """Whether planners are ranked on a sample of the microbatches (``eval_microbatches``)."""
    return eval_microbatches(spec.microbatches, placement) < spec.microbatches


def checked_limit(name: str, spec: ScheduleSpec, placement: Placement, limit: float | None) -> CostModel:
    """The costs, once they and ``limit`` can plan anything (one microbatch on every chunk of a rank)."""
    costs = spec.cost_model()
    check_memory_costs(name, costs)
    need = min_memory_limit(placement, costs)
    if limit is not None and limit < need - EPS:
        raise ScheduleError(
            f"{name} needs --memory-limit >= {need:g} (one microbatch's activations on every chunk of a rank) "
            f"for pp={spec.pp}, got {limit:g}"
        )
    return costs


def uniform(costs: CostModel) -> bool:
    """Every stage has the same times and memory."""
    return all(
        len(set(values)) == 1 for values in (costs.t_f, costs.t_b, costs.t_w, costs.mem_f, costs.mem_b, costs.mem_w)
    )


def greedy_planners(
    placement: Placement, costs: CostModel, limit: float | None, switches: Iterable[Switches] = ALL_SWITCHES
) -> list[Planner]:
    """The list scheduler with each switch setting (the chunk order only matters with several chunks)."""
    return [
        (lambda m, s=setting: greedy_orders(placement, costs, m, limit, s))
        for setting in switches
        if placement.chunks > 1 or setting.depth_first
    ]


def searched(
    name: str,
    spec: ScheduleSpec,
    placement: Placement,
    limit: float | None,
    seeds: Iterable[Schedule | Result] = (),
    planners: Sequence[Planner] = (),
    switches: Iterable[Switches] = ALL_SWITCHES,
    lean: bool = False,
) -> Recipe:
    """A one-placement recipe: ``planners``, the list scheduler with ``switches``, and ``seeds``.

    ``lean``: on large settings with the same costs on every stage, leave the list scheduler
    out. It never beat the round heuristics and the squeezed blocks there on our grid (it does
    with unequal stages), and it is the slow part of planning.
    """
    costs = checked_limit(name, spec, placement, limit)
    every = list(planners)
    if not (lean and large(spec, placement) and uniform(costs)):
        every += greedy_planners(placement, costs, limit, switches)
    fixed = list(seeds)
    return Recipe(name, spec, (placement,), limit, every, (lambda: fixed,))
