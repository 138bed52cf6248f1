"""The registry keeps recent plans: the same request is planned once, a different one never shares a plan."""

import gc

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.registry import ScheduleSpec, _without_collections, build, get, names


def test_the_same_request_is_planned_once():
    spec = ScheduleSpec(4, 8, costs=CostModel(4, t_w=0.6))
    assert build("zb-2p", spec) is build("zb-2p", ScheduleSpec(4, 8, costs=CostModel(4, t_w=0.6)))


def test_a_limit_the_schedule_does_not_plan_with_shares_its_plan_and_still_refuses():
    plain = build("zb-h1", ScheduleSpec(4, 8))
    assert build("zb-h1", ScheduleSpec(4, 8, memory_limit=4)) is plain
    with pytest.raises(ScheduleError, match="zb-h1 needs --memory-limit >= 4"):
        build("zb-h1", ScheduleSpec(4, 8, memory_limit=3), suggest=False)


def test_a_limit_the_schedule_plans_with_gets_its_own_plan():
    assert build("zb-auto", ScheduleSpec(4, 8, memory_limit=3)) is not build("zb-auto", ScheduleSpec(4, 8))
    assert build("zb-auto", ScheduleSpec(4, 8, memory_limit=3)).orders != build("zb-auto", ScheduleSpec(4, 8)).orders


def test_other_costs_or_chunks_get_their_own_plan():
    spec = ScheduleSpec(4, 8)
    assert build("zb-2p", spec) is not build("zb-2p", ScheduleSpec(4, 8, costs=CostModel(4, t_w=0.6)))
    assert build("zb-2p", ScheduleSpec(4, 8, chunks=2)).chunks == 2


def test_a_solver_refined_plan_is_not_kept():
    spec = ScheduleSpec(2, 4, refine_seconds=0.1)
    assert build("zb-1p", spec) is not build("zb-1p", spec)


def test_generators_run_with_the_cyclic_collector_paused_and_give_it_back():
    seen = []

    def planner(spec):
        seen.append(gc.isenabled())
        if spec.microbatches == 1:
            raise ScheduleError("refused")
        return get("1f1b").generate(spec)  # a generator inside another leaves the pause to the outer one

    wrapped = _without_collections(planner)
    assert gc.isenabled()
    assert wrapped(ScheduleSpec(2, 4)).name == "1f1b" and seen == [False] and gc.isenabled()
    with pytest.raises(ScheduleError, match="refused"):
        wrapped(ScheduleSpec(2, 1))
    assert gc.isenabled()
    assert all(get(name).generate.__wrapped__ for name in names())  # every registered generator
