"""The planning-time cuts change no plan: auto's ceiling, the list scheduler's kept runs, zb-auto's shared search."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest

from megatron_zb.schedule import registry
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators import auto, breadth_first, greedy, search, v_auto, v_family, zb_auto
from megatron_zb.schedule.generators.greedy import ALL_SWITCHES, Pruned, greedy_orders, pruned_above
from megatron_zb.schedule.generators.result import timed_schedule
from megatron_zb.schedule.generators.search import Ceiling, Unreachable, ceiling, time_bound
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.placement import interleaved, linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, get


def uneven(p: int, comm: float = 0.1) -> CostModel:
    """Heavier first and last stages, as the planning-time benchmark's profile."""
    scale = [1.4 if s == 0 else 1.6 if s == p - 1 else 1.0 for s in range(p)]
    return CostModel(p, t_f=scale, t_b=[1.1 * x for x in scale], t_w=[0.7 * x for x in scale], t_comm=comm)


def test_time_bound_closed_form() -> None:
    # unit costs, no comm: rank 3's first F waits for 3 Fs, then does 8 x (F + B + W)
    assert time_bound(CostModel(4), linear(4), 8) == 3 + 24
    assert time_bound(CostModel(4), linear(4), 8, span=True) == 24
    # V, two chunks of half a stage: rank 0 holds blocks 0 and 7 (3 microbatch-units of work each half)
    assert time_bound(CostModel(4, t_comm=0.5), v_shape(4), 8) == pytest.approx(max(r * 1.0 + 24 for r in range(4)))


@pytest.mark.parametrize("name, chunks", [("zb-1p", 1), ("zb-2p", 2), ("zb-auto", 4), ("zb-v", None), ("1f1b", None)])
def test_time_bound_never_above_a_plan(name: str, chunks: int | None) -> None:
    p, m = 4, 12
    costs = uneven(p, comm=0.3)
    schedule = build(name, ScheduleSpec(p, m, chunks, costs))
    result = timed_schedule(schedule, costs)
    (placement,) = schedule.placements
    assert time_bound(costs, placement, m) <= result.makespan + 1e-9
    assert time_bound(costs, placement, m, span=True) <= result.stage_span + 1e-9


def test_ceiling_refuses_before_planning() -> None:
    spec = ScheduleSpec(4, 8, 2, uneven(4))
    planned = get("zb-auto").generate(spec)
    bound = time_bound(spec.cost_model(), interleaved(4, 2), 8)
    with ceiling(Ceiling(bound * 0.99)), pytest.raises(Unreachable, match="no makespan under"):
        get("zb-auto").generate(replace(spec, memory_limit=7.0))  # a setting not planned before
    with ceiling(Ceiling(bound)):
        assert get("zb-auto").generate(spec).orders == planned.orders


@pytest.mark.parametrize("p, m, limit, post_validation", [(4, 8, 4.0, False), (4, 12, None, True), (6, 12, 6.0, False)])
def test_auto_picks_as_without_ceiling(monkeypatch, p: int, m: int, limit: float | None, post_validation: bool) -> None:
    spec = ScheduleSpec(p, m, costs=uneven(p), memory_limit=limit, post_validation=post_validation)
    pruned = auto.generate(spec)
    for module in (search, v_auto, v_family, zb_auto):
        monkeypatch.setattr(module, "check_ceiling", lambda name, spec, placements: None)
    monkeypatch.setattr(breadth_first, "check_memory_floor", lambda name, floor: None)
    registry._planned.cache_clear()  # plan every family afresh, nothing refused
    registry._generated.cache_clear()
    whole = auto.generate(spec)
    assert (pruned.name, pruned.orders) == (whole.name, whole.orders)


def test_a_breadth_first_plan_over_auto_s_limit_is_refused_unplanned() -> None:
    spec = ScheduleSpec(4, 8, 2, uneven(4), memory_limit=6.0)
    with ceiling(Ceiling(math.inf, memory=6.0)), pytest.raises(Unreachable, match="holds at least 8 at once"):
        get("breadth-first-zb").generate(spec)  # 8 microbatches x 2 chunks of half a stage before a backward
    unlimited = build("breadth-first-zb", replace(spec, memory_limit=None))
    assert registry.peak_memory(unlimited, spec.cost_model()) >= 8


@pytest.mark.parametrize("placement", [linear(4), interleaved(4, 2), v_shape(4)])
def test_a_run_is_pruned_exactly_when_its_span_is_over_the_bound(placement) -> None:
    costs, m = uneven(4, comm=0.2), 12
    for setting in ALL_SWITCHES[:8]:
        greedy._RUNS.clear()
        try:
            whole = greedy_orders(placement, costs, m, 6.0, setting)
        except ScheduleError:
            continue
        for bound in (0.97 * whole.stage_span, whole.stage_span, 1.03 * whole.stage_span):
            greedy._RUNS.clear()
            with pruned_above(bound):
                if whole.stage_span > bound * (1 + 1e-9):
                    with pytest.raises(Pruned, match="stage span would be over"):
                        greedy_orders(placement, costs, m, 6.0, setting)
                else:
                    assert greedy_orders(placement, costs, m, 6.0, setting).codes == whole.codes


@pytest.mark.parametrize(
    "name, p, m, chunks, limit",
    [
        ("zb-1p", 16, 128, 2, None),
        ("zb-2p", 8, 24, None, None),
        ("zb-v", 8, 40, None, None),
        ("v-auto", 8, 32, None, 6.0),
    ],
)
def test_pruned_searches_plan_as_unpruned_ones(monkeypatch, name: str, p: int, m: int, chunks, limit) -> None:
    """zb-1p at pp 16, m 128 on 2 chunks ranks its planners on a sample (``search.eval_microbatches``)."""
    spec = ScheduleSpec(p, m, chunks, uneven(p), memory_limit=limit)
    greedy._RUNS.clear()
    pruned = get(name).generate(spec)
    monkeypatch.setattr(search, "pruned_above", lambda span: contextlib.nullcontext())
    greedy._RUNS.clear()
    zb_auto._zb_auto.cache_clear()
    whole = get(name).generate(spec)
    assert pruned.orders == whole.orders


def test_kept_runs_are_the_runs_of_their_limits() -> None:
    placement, costs, m = interleaved(4, 2), uneven(4), 10
    limits = [None, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 50.0]
    greedy._RUNS.clear()
    kept = {(limit, s): greedy_orders(placement, costs, m, limit, s) for limit in limits for s in ALL_SWITCHES[:4]}
    for (limit, setting), result in kept.items():
        greedy._RUNS.clear()
        fresh = greedy_orders(placement, costs, m, limit, setting)
        assert (fresh.codes, fresh.stage_span, fresh.peak) == (result.codes, result.stage_span, result.peak)
    greedy._RUNS.clear()
    unlimited = greedy_orders(placement, costs, m, None)
    assert greedy_orders(placement, costs, m, unlimited.peak + 100) is unlimited  # no check can fail there


def test_zb_auto_at_1f1b_memory_is_zb_1p() -> None:
    spec = ScheduleSpec(4, 12, 2, uneven(4))
    one_p = get("zb-1p").generate(spec)
    same = get("zb-auto").generate(replace(spec, memory_limit=4.0))
    assert (one_p.name, same.name) == ("zb-1p", "zb-auto")
    assert one_p.orders == same.orders
    with pytest.raises(ScheduleError, match=r"^zb-auto needs --memory-limit >= 1 ") as refused:
        get("zb-auto").generate(replace(spec, memory_limit=0.5))
    assert "<" not in str(refused.value)
