"""The planning-time cuts change no plan: auto's ceiling, the list scheduler's kept runs, zb-auto's shared search."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_zb.schedule import registry
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators import auto, greedy, search, v_auto
from megatron_zb.schedule.generators.greedy import ALL_SWITCHES, greedy_orders
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
    for module in (search, v_auto):
        monkeypatch.setattr(module, "check_ceiling", lambda name, spec, placements: None)
    registry._planned.cache_clear()  # plan every family afresh, nothing refused
    whole = auto.generate(spec)
    assert (pruned.name, pruned.orders) == (whole.name, whole.orders)


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
