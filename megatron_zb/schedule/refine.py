"""Optional solver refinement: reorder each rank's passes with CP-SAT to shorten the stage span.

The paper refines its heuristic schedule with an ILP under a time limit; this does the same
with OR-Tools CP-SAT on the schedule's own passes, so it works for any placement or pipe.
The solver only proposes an order per rank: the result is re-checked by the validator and
re-timed by the simulator, and kept only if it is strictly shorter, so a refined schedule is
never worse than its input. OR-Tools is an optional dependency, imported only when used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from fractions import Fraction
from itertools import accumulate, pairwise
from types import ModuleType
from typing import Any

from .costs import CostModel
from .deps import inputs, roles
from .execute import execute
from .ir import Pass, PassKind, Schedule, ScheduleError
from .simulate import memory_levels, simulate
from .validate import MEMORY_TOLERANCE, check, validate

log = logging.getLogger(__name__)

MISSING_ORTOOLS = "--refine-seconds needs OR-Tools: pip install 'megatron-zb[refine]'"
TIME_RESOLUTION = 1000  # integer units for the shortest pass when costs are not simple fractions
MEMORY_RESOLUTION = 10**6  # units for the smallest memory change (the grid barely affects the search)
MAX_DENOMINATOR = 1000  # costs like 1.2 or 0.05 become exact integers (x20) rather than rounded ones
EXPAND_RESERVOIR_UP_TO = 64  # passes per rank
RANDOM_SEED = 0
WORKERS = 2


def refine(schedule: Schedule, costs: CostModel, memory_limit: float | None, seconds: float) -> Schedule:
    """A reordering of ``schedule`` with a shorter stage span, or ``schedule`` itself.

    Spends at most ``seconds`` in CP-SAT; ``seconds <= 0`` returns the input untouched without
    importing OR-Tools. The result fits ``memory_limit`` (None: unlimited). With a wall-clock
    limit and two workers the answer can differ between runs (and machines) whenever several
    orders are equally good or the limit cuts the search: refine once and share the result,
    never independently on every rank.
    """
    if seconds <= 0:
        return schedule
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise ScheduleError(MISSING_ORTOOLS) from error
    check(schedule, costs)
    before = simulate(schedule, costs).stage_span
    model, starts, time_scale = _model(cp_model, schedule, costs, memory_limit)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = WORKERS
    solver.parameters.random_seed = RANDOM_SEED
    # Probing in presolve can take most of a few seconds before the hint is even loaded; the
    # improvements come from the search (large neighbourhoods), not from the proof.
    solver.parameters.cp_model_probing_level = 0
    # Expanding the reservoirs into pairwise orders (quadratic in passes per rank) helps prove
    # small cases optimal; on long ranks it eats the budget and memory before the search starts.
    solver.parameters.expand_reservoir_constraints = max(map(len, schedule.orders)) <= EXPAND_RESERVOIR_UP_TO
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        log.info("refine %s: solver found no schedule (%s)", schedule.name, solver.status_name(status))
        return schedule
    position = {p: i for order in schedule.orders for i, p in enumerate(order)}
    orders = tuple(
        tuple(sorted(order, key=lambda p: (solver.value(starts[p]), position[p]))) for order in schedule.orders
    )
    refined = Schedule(schedule.name, schedule.placements, schedule.microbatches, orders)
    issues = validate(refined, costs, memory_limit)
    after = simulate(refined, costs).stage_span if not issues else math.inf
    better = after < before - 1e-9
    log.info(
        "refine %s: stage span %g, solver %s at %g, %s",
        schedule.name,
        before,
        solver.status_name(status),
        solver.objective_value / time_scale,
        f"refined to {after:g}" if better else f"kept the input ({len(issues)} issues, span {after:g})",
    )
    return refined if better else schedule


def _model(
    cp_model: ModuleType, schedule: Schedule, costs: CostModel, memory_limit: float | None
) -> tuple[Any, dict[Pass, Any], int]:
    """CP-SAT model: one interval per pass, the dependency rule, memory, the stage-span objective.

    Times become integers (``_scale``); the hint is the input's own timing on that grid, so
    the solver starts from a feasible schedule and only has to improve on it.
    """
    passes = [p for order in schedule.orders for p in order]
    placement = {p: schedule.placements[p.pipe] for p in passes}
    seconds = {p: costs.duration(p, placement[p]) for p in passes}
    time_scale = _scale(seconds.values(), [costs.t_comm], TIME_RESOLUTION)
    # At least one unit each, so the passes of a rank start at distinct times and sort uniquely.
    duration = {p: max(1, round(t * time_scale)) for p, t in seconds.items()}
    latency = round(costs.t_comm * time_scale)
    horizon = sum(duration.values()) + latency * len(passes)

    model = cp_model.CpModel()
    start = {p: model.new_int_var(0, horizon, f"start {p}") for p in passes}
    end = {p: start[p] + duration[p] for p in passes}
    for order in schedule.orders:
        model.add_no_overlap([model.new_fixed_size_interval_var(start[p], duration[p], str(p)) for p in order])

    producer = {role: p for p in passes for role in roles(p)}
    for p in passes:
        for role in inputs(p, schedule.num_stages(p.pipe)):
            q = producer[role]
            lag = latency if schedule.rank_of(q) != schedule.rank_of(p) else 0
            model.add(start[p] >= end[q] + lag)
    for chain in _microbatch_chains(schedule):
        for earlier, later in pairwise(chain):
            model.add(start[later] >= end[earlier])
    if memory_limit is not None:
        _add_memory(model, schedule, costs, memory_limit, start)

    # The hint is complete (every variable), so CP-SAT takes it as its first solution at once.
    warm = execute(schedule, duration.__getitem__, latency)
    spans, warm_spans = [], []
    for rank, (order, timings) in enumerate(zip(schedule.orders, warm, strict=True)):
        for p, timing in zip(order, timings, strict=True):
            model.add_hint(start[p], int(timing.start))
        if order:
            first, last = model.new_int_var(0, horizon, f"first {rank}"), model.new_int_var(0, horizon, f"last {rank}")
            model.add_min_equality(first, [start[p] for p in order])
            model.add_max_equality(last, [end[p] for p in order])
            model.add_hint(first, int(timings[0].start))
            model.add_hint(last, int(timings[-1].end))
            spans.append(last - first)
            warm_spans.append(int(timings[-1].end - timings[0].start))
    span = model.new_int_var(0, horizon, "stage span")
    model.add_max_equality(span, spans)
    model.add_hint(span, max(warm_spans))
    model.minimize(span)
    return model, start, time_scale


def _add_memory(model: Any, schedule: Schedule, costs: CostModel, memory_limit: float, start: dict[Pass, Any]) -> None:
    """Per rank, a reservoir changed at the start of each pass.

    The validator counts memory after each pass in rank order; passes of a rank start at
    distinct times, so the level after the event at a pass's start is that same count.
    """
    delta = {p: costs.memory_delta(p, schedule.placements[p.pipe]) for order in schedule.orders for p in order}
    scale = _scale(delta.values(), [memory_limit], MEMORY_RESOLUTION)
    level = {p: round(d * scale) for p, d in delta.items()}
    max_level = max(0, math.floor((memory_limit + MEMORY_TOLERANCE) * scale))
    if max(max((0.0, *levels)) for levels in memory_levels(schedule, costs)) <= memory_limit + MEMORY_TOLERANCE:
        # Rounded levels may drift from the exact ones; keep the input (the hint) feasible.
        max_level = max([max_level, *(max(accumulate(level[p] for p in order)) for order in schedule.orders if order)])
    for order in schedule.orders:
        min_level = min(0, -sum(abs(level[p]) for p in order))
        model.add_reservoir_constraint([start[p] for p in order], [level[p] for p in order], min_level, max_level)


def _microbatch_chains(schedule: Schedule) -> list[list[Pass]]:
    """Symmetry breaking: per stage and kind, the passes in microbatch order, where the input has it.

    Microbatches are interchangeable, so most solutions have mirror images that differ only
    in their labels; keeping the input's order removes them. It rules out microbatches
    overtaking one another on a stage, which good schedules rarely need.
    """
    groups: dict[tuple[int, int, PassKind], list[Pass]] = {}
    for order in schedule.orders:
        for p in order:
            groups.setdefault((p.pipe, p.stage, p.kind), []).append(p)
    return [chain for chain in groups.values() if all(a.microbatch < b.microbatch for a, b in pairwise(chain))]


def _scale(values: Iterable[float], others: Iterable[float], resolution: int) -> int:
    """Integer factor for ``values`` and ``others``: exact when all are simple fractions.

    Otherwise the smallest of ``values`` gets ``resolution`` units and everything is rounded.
    """
    main = [abs(v) for v in values if v]
    every = main + [abs(v) for v in others if v]
    fractions = [Fraction(v).limit_denominator(MAX_DENOMINATOR) for v in every]
    if all(abs(f - Fraction(v)) <= 1e-12 * max(1.0, v) for f, v in zip(fractions, every, strict=True)):
        scale = math.lcm(1, *(f.denominator for f in fractions))
        if scale <= MAX_DENOMINATOR**2:
            return scale
    return math.ceil(resolution / min(main or every or [1.0]))
