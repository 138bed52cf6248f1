"""Pick the best of several candidate orders by stage span (then makespan, then peak memory).

A candidate is either a *planner*, a heuristic that plans any number of microbatches (the
list scheduler with one switch setting, a round heuristic), or a *seed*, a fixed order (the
handmade and PyTorch-style schedules, the V building blocks). Planners are ranked on a sample
of the microbatches when planning all of them for every candidate would be slow; the best
ones are then planned for all. Seeds are timed on all microbatches and kept when they fit the
memory limit, so the result is never worse than any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..costs import CostModel
from ..ir import Pass, Schedule, ScheduleError
from ..placement import Placement
from ..registry import ScheduleSpec
from ..simulate import Timeline
from .greedy import ALL_SWITCHES, Switches, check_memory_costs, greedy_orders, min_memory_limit
from .result import Result
from .timing import timed

EPS = 1e-9
Planner = Callable[[int], Result]  # plans m microbatches; raises ScheduleError when it cannot
EVAL_PASSES = 12_000  # above this many passes, planners are ranked on fewer microbatches
CONFIRM = 2  # planners planned for all microbatches after ranking on a sample (distinct sample scores)


def score(timeline: Timeline) -> tuple[float, float, float]:
    return (round(timeline.stage_span, 9), round(timeline.makespan, 9), round(max(timeline.peak_memory), 9))


def lower_bound(costs: CostModel, placement: Placement | None = None) -> float:
    """No stage span is shorter than the busiest rank's work per microbatch."""
    if placement is None:
        return max(costs.work_per_microbatch(stage) for stage in range(costs.pp))
    work = [0.0] * placement.pp
    for block, (rank, _) in enumerate(placement.blocks):
        work[rank] += costs.work_per_microbatch(placement.full_stage(block)) / placement.chunks
    return max(work)


def check_limit(name: str, spec: ScheduleSpec, placement: Placement, limit: float | None) -> CostModel:
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


def eval_microbatches(m: int, placement: Placement) -> int:
    """How many microbatches planners are ranked on: all of them unless that is slow."""
    if 3 * m * placement.num_stages <= EVAL_PASSES:
        return m
    return min(m, max(2 * placement.pp, EVAL_PASSES // (3 * placement.num_stages)))


def best_plan(
    planners: Sequence[Planner], placement: Placement, costs: CostModel, m: int, limit: float | None
) -> Result | None:
    """The best planner's orders for m microbatches (None if none can plan them)."""
    floor = round(m * lower_bound(costs, placement), 9)
    m_eval = eval_microbatches(m, placement)
    ranked: list[tuple[tuple[float, float, float], int]] = []
    best: Result | None = None
    for index, planner in enumerate(planners):
        try:
            result = planner(m_eval)
        except ScheduleError:
            continue
        if m_eval == m:
            best = _better(best, result, limit)
            if best is not None and best.score()[0] <= floor:
                return best
        else:
            ranked.append((result.score(), index))
    confirmed: set[tuple[float, float, float]] = set()
    for ranked_score, index in sorted(ranked):
        if len(confirmed) == CONFIRM:
            break
        if ranked_score in confirmed:
            continue  # ties on the sample are usually the same orders: plan one of them
        confirmed.add(ranked_score)
        try:
            best = _better(best, planners[index](m), limit)
        except ScheduleError:
            continue
    return best


def _better(best: Result | None, result: Result, limit: float | None) -> Result | None:
    if limit is not None and result.peak > limit + EPS:
        return best
    return result if best is None or result.score() < best.score() else best


def with_seeds(
    best: Result | None,
    seeds: Iterable[Schedule | Result],
    placement: Placement,
    costs: CostModel,
    limit: float | None,
) -> Result | None:
    """The best of ``best`` and the seeds that fit the limit (one-pipe schedules on ``placement``, or timed orders)."""
    for seed in seeds:
        result = seed if isinstance(seed, Result) else timed(seed.orders, placement, costs, seed.microbatches)
        if result is not None:
            best = _better(best, result, limit)
    return best


def search(
    name: str,
    spec: ScheduleSpec,
    placement: Placement,
    limit: float | None,
    seeds: Iterable[Schedule | Result] = (),
    planners: Sequence[Planner] = (),
    switches: Iterable[Switches] = ALL_SWITCHES,
    lean: bool = False,
) -> Result:
    """The best of ``planners``, the list scheduler with ``switches`` and ``seeds``.

    ``lean``: on large settings with the same costs on every stage, leave the list scheduler
    out. It never beat the round heuristics and the squeezed blocks there on our grid (it does
    with unequal stages), and it is the slow part of planning.
    """
    costs = check_limit(name, spec, placement, limit)
    every = list(planners)
    large = eval_microbatches(spec.microbatches, placement) < spec.microbatches
    if not (lean and large and uniform(costs)):
        every += greedy_planners(placement, costs, limit, switches)
    best = with_seeds(best_plan(every, placement, costs, spec.microbatches, limit), seeds, placement, costs, limit)
    if best is None:
        raise ScheduleError(f"{name}: no heuristic could plan pp={spec.pp}, microbatches={spec.microbatches}")
    return best


def searched(
    name: str,
    spec: ScheduleSpec,
    placement: Placement,
    limit: float | None,
    seeds: Iterable[Schedule | Result] = (),
    planners: Sequence[Planner] = (),
    switches: Iterable[Switches] = ALL_SWITCHES,
    lean: bool = False,
) -> Schedule:
    """``search`` as a schedule, refined by the solver if asked."""
    best = search(name, spec, placement, limit, seeds, planners, switches, lean)
    return finish(name, spec, placement, spec.cost_model(), limit, best.orders)


def finish(
    name: str,
    spec: ScheduleSpec,
    placement: Placement,
    costs: CostModel,
    limit: float | None,
    orders: Sequence[Sequence[Pass]],
) -> Schedule:
    schedule = Schedule(name, (placement,), spec.microbatches, tuple(tuple(order) for order in orders))
    if spec.refine_seconds > 0:
        from ..refine import refine

        schedule = refine(schedule, costs, limit, spec.refine_seconds)
    return schedule
