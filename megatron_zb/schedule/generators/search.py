"""Pick the best of several candidate orders by simulated stage span (then makespan, then memory)."""

from __future__ import annotations

from collections.abc import Iterable

from ..costs import CostModel
from ..ir import Pass, Schedule, ScheduleError
from ..placement import Placement
from ..registry import ScheduleSpec
from ..simulate import Timeline, simulate
from .greedy import ALL_SWITCHES, Switches, check_memory_costs, greedy_orders, min_memory_limit

EPS = 1e-9


def score(timeline: Timeline) -> tuple[float, float, float]:
    return (round(timeline.stage_span, 9), round(timeline.makespan, 9), round(max(timeline.peak_memory), 9))


def lower_bound(costs: CostModel) -> float:
    """No stage span is shorter than the busiest rank's work (one stage's worth per microbatch)."""
    return max(costs.work_per_microbatch(stage) for stage in range(costs.pp))


def searched(
    name: str,
    spec: ScheduleSpec,
    placement: Placement,
    limit: float | None,
    seeds: Iterable[Schedule] = (),
    switches: Iterable[Switches] = ALL_SWITCHES,
) -> Schedule:
    """The list scheduler over every switch setting, plus ``seeds``; refined by the solver if asked.

    Large settings rank the switches on 3pp microbatches, which cover warm-up, steady state
    and cool-down; the winner is then planned for all m.
    """
    costs = spec.cost_model()
    check_memory_costs(name, costs)
    need = min_memory_limit(placement, costs)
    if limit is not None and limit < need - EPS:
        raise ScheduleError(
            f"{name} needs --memory-limit >= {need:g} (one microbatch's activations on every chunk of a rank) "
            f"for pp={spec.pp}, got {limit:g}"
        )
    m, m_eval = spec.microbatches, eval_microbatches(spec, placement)
    target = round(m_eval * lower_bound(costs), 9)
    ranked: list[tuple[tuple[float, float, float], Switches]] = []
    best = None
    for setting in switches:
        if placement.chunks == 1 and not setting.depth_first:
            continue  # the chunk order does not matter with one chunk
        ranked.append((greedy_orders(placement, costs, m_eval, limit, setting).score(), setting))
        if ranked[-1][0][0] <= target:  # optimal on the sample: confirm on all microbatches
            result = greedy_orders(placement, costs, m, limit, setting)
            best = (result.score(), _schedule(name, placement, m, result.orders))
            if best[0][0] <= round(m * lower_bound(costs), 9):
                break
    if best is None or best[0][0] > round(m * lower_bound(costs), 9):
        setting = min(ranked, key=lambda item: item[0])[1]
        result = greedy_orders(placement, costs, m, limit, setting)
        if best is None or result.score() < best[0]:
            best = (result.score(), _schedule(name, placement, m, result.orders))
    optimal = best[0][0] <= round(m * lower_bound(costs), 9)
    for seed in () if optimal else seeds:
        timeline = simulate(seed, costs)
        if (limit is None or max(timeline.peak_memory) <= limit + EPS) and score(timeline) < best[0]:
            best = (score(timeline), Schedule(name, seed.placements, seed.microbatches, seed.orders))
    best = best[1]
    if spec.refine_seconds > 0:
        from ..refine import refine

        best = refine(best, costs, limit, spec.refine_seconds)
    return best


LADDER_SWITCHES = (Switches(prefer_b=True), Switches(prefer_b=False))
LADDER_BUDGET = 320_000  # passes the ladder may schedule; bounds planning time at large pp and m
EVAL_PASSES = 30_000  # larger settings rank candidates on 3 * pp microbatches (the steady state repeats)


def eval_microbatches(spec: ScheduleSpec, placement: Placement) -> int:
    """How many microbatches candidates are ranked on: all of them unless that is slow."""
    if 3 * spec.microbatches * placement.num_stages <= EVAL_PASSES:
        return spec.microbatches
    return min(spec.microbatches, 3 * spec.pp)


def laddered(
    name: str, spec: ScheduleSpec, placement: Placement, limit: float | None, seeds: Iterable[Schedule] = ()
) -> Schedule:
    """Best schedule over a fixed ladder of memory caps at or below ``limit``.

    The ladder depends on the setting, never on ``limit``, so a larger limit only adds
    candidates: the stage span can only shrink as the limit grows. List scheduling alone
    has no such guarantee (more room for warm-up forwards can delay a B). Steps are the
    memory quantum (the smallest per-chunk delta, exact for uniform deltas) unless the
    budget asks for fewer points. Large settings rank candidates on 3pp microbatches, then
    plan the winner for all of them.
    """
    costs = spec.cost_model()
    check_memory_costs(name, costs)
    need = min_memory_limit(placement, costs)
    if limit is not None and limit < need - EPS:
        raise ScheduleError(
            f"{name} needs --memory-limit >= {need:g} (one microbatch's activations on every chunk of a rank) "
            f"for pp={spec.pp}, got {limit:g}"
        )
    m_eval = eval_microbatches(spec, placement)
    unlimited = greedy_orders(placement, costs, m_eval, None)
    quantum = min(abs(d) / placement.chunks for d in (*costs.mem_f, *costs.mem_b, *costs.mem_w) if d)
    fine = int((unlimited.peak - need) / quantum + EPS) + 1
    passes = 3 * m_eval * placement.num_stages
    points = max(2, LADDER_BUDGET // (passes * len(LADDER_SWITCHES)))
    step = quantum * -(-fine // points)
    ranked: list[tuple[tuple[float, float, float], float | None, Switches]] = []
    if limit is None or unlimited.peak <= limit + EPS:
        ranked.append((unlimited.score(), None, Switches()))
    cap = need
    while cap <= min(limit if limit is not None else unlimited.peak, unlimited.peak) + EPS:
        for setting in LADDER_SWITCHES:
            ranked.append((greedy_orders(placement, costs, m_eval, cap, setting).score(), cap, setting))
        cap += step
    _, cap, setting = min(ranked, key=lambda item: item[0])
    result = greedy_orders(placement, costs, spec.microbatches, cap, setting)
    best, best_score = _schedule(name, placement, spec.microbatches, result.orders), result.score()
    for seed in seeds:
        timeline = simulate(seed, costs)
        if (limit is None or max(timeline.peak_memory) <= limit + EPS) and score(timeline) < best_score:
            best, best_score = Schedule(name, seed.placements, seed.microbatches, seed.orders), score(timeline)
    if spec.refine_seconds > 0:
        from ..refine import refine

        best = refine(best, costs, limit, spec.refine_seconds)
    return best


def _schedule(name: str, placement: Placement, m: int, orders: list[list[Pass]]) -> Schedule:
    return Schedule(name, (placement,), m, tuple(tuple(order) for order in orders))
