"""Data-parallel actions in the IR: lowering, the dependency rule, the validator and the simulator."""

from __future__ import annotations

from dataclasses import fields

import pytest

from megatron_zb.schedule import CostModel, Pass, PassKind, Schedule, ScheduleSpec, build, names, simulate, validate
from megatron_zb.schedule.actions import SPECS
from megatron_zb.schedule.ir import ScheduleError, parse_orders
from megatron_zb.schedule.lower import DataParallel, add_gathers, add_reduce_grad, lower
from megatron_zb.schedule.placement import interleaved, linear
from megatron_zb.schedule.registry import get


def compute_only(schedule: Schedule) -> tuple[tuple[Pass, ...], ...]:
    return tuple(tuple(p for p in order if p.kind.is_compute) for order in schedule.orders)


@pytest.mark.parametrize("name", [name for name in names() if not get(name).composite])
def test_every_schedule_lowers_to_its_passes_plus_one_reduction_per_chunk(name):
    try:
        schedule = build(name, ScheduleSpec(4, 8))
    except ScheduleError:
        pytest.skip(f"{name} does not run pp=4, m=8")
    lowered = add_reduce_grad(schedule)
    assert compute_only(lowered) == schedule.orders
    assert validate(lowered) == []
    for rank, order in enumerate(lowered.orders):
        reductions = [i for i, p in enumerate(order) if p.kind is PassKind.REDUCE_GRAD]
        assert len(reductions) == schedule.chunks  # one per chunk of the rank
        for i in reductions:
            stage = order[i].stage
            last_w = max(j for j, p in enumerate(order) if p.stage == stage and p.kind in (PassKind.W, PassKind.BW))
            assert i == last_w + 1, (rank, order[i])


def test_action_text_round_trips():
    text = "rank 0: UNSHARD s0, F s0 mb0, RESHARD s0, UNSHARD s0 #1, BW s0 mb0, REDUCE_GRAD s0, RESHARD s0 #1"
    orders = parse_orders(text)
    assert Schedule("t", (linear(1),), 1, orders).to_text() == text
    assert orders[0][3] == Pass(PassKind.UNSHARD, 0, 1)


def test_zero3_windows_follow_the_runs_of_each_chunk_with_prefetch():
    # rank 0 of a pp=1, two-chunk order: F of chunk 0 twice, F of chunk 1 twice, then backward in reverse
    orders = parse_orders("rank 0: F s0 mb0, F s0 mb1, F s1 mb0, F s1 mb1, BW s1 mb0, BW s1 mb1, BW s0 mb0, BW s0 mb1")
    schedule = Schedule("bf", (interleaved(1, 2),), 2, orders)
    lowered = lower(schedule, DataParallel(gather="windows", prefetch=1))
    assert lowered.to_text() == (
        "rank 0: UNSHARD s0, F s0 mb0, UNSHARD s1, F s0 mb1, RESHARD s0, F s1 mb0, F s1 mb1, BW s1 mb0, "
        "UNSHARD s0 #1, BW s1 mb1, REDUCE_GRAD s1, RESHARD s1, BW s0 mb0, BW s0 mb1, REDUCE_GRAD s0, RESHARD s0 #1"
    )
    assert validate(lowered) == []
    once = lower(schedule, DataParallel(gather="once"))
    assert [str(p) for p in once.orders[0] if not p.kind.is_compute] == [
        "UNSHARD s0",
        "UNSHARD s1",
        "REDUCE_GRAD s1",
        "REDUCE_GRAD s0",
    ]


def test_collectives_overlap_compute_and_gathered_weights_count_in_memory():
    """pp=1, two chunks (each half a stage), unit costs, t_dp = 1 per stage (0.5 per chunk)."""
    orders = parse_orders("rank 0: F s0 mb0, F s0 mb1, F s1 mb0, F s1 mb1, BW s1 mb0, BW s1 mb1, BW s0 mb0, BW s0 mb1")
    schedule = Schedule("bf", (interleaved(1, 2),), 2, orders)
    costs = CostModel(1, t_dp=1.0, mem_param=2.0)
    timeline = simulate(lower(schedule, DataParallel(gather="windows", prefetch=1)), costs)
    spans = {str(t.pass_): (t.start, t.end) for t in timeline.ranks[0]}
    # The first gather is exposed (nothing to hide it behind); the next one, issued one compute pass
    # ahead (prefetch 1), runs beside F s0 mb1.
    assert spans["UNSHARD s0"] == (0.0, 0.5)
    assert spans["F s0 mb0"] == (0.5, 1.0)
    assert spans["UNSHARD s1"] == spans["F s0 mb1"] == (1.0, 1.5)
    assert spans["F s1 mb0"] == (1.5, 2.0)
    # s0's second gather is issued before BW s1 mb1 and overlaps it; s1's reduction overlaps BW s0 mb0.
    assert spans["UNSHARD s0 #1"] == (3.5, 4.0)
    assert spans["REDUCE_GRAD s1"] == (4.5, 5.0)
    assert spans["RESHARD s1"] == (5.0, 5.0)  # released once the reduction has read the gradients
    assert spans["BW s0 mb0"] == (4.5, 5.5)
    assert spans["REDUCE_GRAD s0"] == (6.5, 7.0)
    assert timeline.makespan == 7.0  # 6 of compute, the first gather and the last reduction exposed
    assert timeline.work == (6.0,)
    # memory: at the peak, 1.5 of activations (three chunk-microbatches) and two gathered chunks (1 each),
    # after UNSHARD s0 #1 is issued while BW s1 mb1 still holds its activations
    assert max(timeline.memory[0]) == pytest.approx(3.5)
    assert timeline.memory[0][8] == pytest.approx(3.5)


def test_without_data_parallel_costs_lowering_changes_no_time():
    schedule = build("zb-2p", ScheduleSpec(4, 8))
    plain = simulate(schedule)
    lowered = simulate(lower(schedule, DataParallel(gather="windows")))
    assert (lowered.makespan, lowered.stage_span, lowered.peak_memory) == (
        plain.makespan,
        plain.stage_span,
        plain.peak_memory,
    )


def issues(text: str, chunks: int = 1, microbatches: int = 1) -> list[str]:
    placement = interleaved(1, chunks) if chunks > 1 else linear(1)
    return [str(issue) for issue in validate(Schedule("hand", (placement,), microbatches, parse_orders(text)))]


def test_validator_names_a_pass_on_released_weights():
    found = issues("rank 0: UNSHARD s0, F s0 mb0, RESHARD s0, BW s0 mb0")
    assert found == [
        "[sharded] rank 0 runs BW s0 mb0 (pass 3) on released weights: no UNSHARD s0 opens a window before it "
        "(gather the weights first)"
    ]


def test_validator_names_a_reduction_before_a_weight_gradient():
    found = issues("rank 0: F s0 mb0, F s0 mb1, BW s0 mb0, REDUCE_GRAD s0, BW s0 mb1", microbatches=2)
    assert found == ["[order] rank 0 runs REDUCE_GRAD s0 (pass 3) before its input W s0 mb1 (pass 4)"]


def test_validator_names_unmatched_and_misnumbered_actions():
    assert issues("rank 0: RESHARD s0, F s0 mb0, BW s0 mb0") == [
        "[actions] rank 0 runs RESHARD s0 (pass 0) with no gathered weights of stage 0 to release"
    ]
    assert issues("rank 0: UNSHARD s0 #1, F s0 mb0, BW s0 mb0") == [
        "[actions] rank 0 runs UNSHARD s0 #1 (pass 0) as occurrence 0 of UNSHARD s0; number them 0, 1, ... in order"
    ]
    assert issues("rank 0: UNSHARD s0, UNSHARD s0 #1, F s0 mb0, BW s0 mb0") == [
        "[actions] rank 0 runs UNSHARD s0 #1 (pass 1) while UNSHARD s0 still holds s0's weights"
    ]
    twice = issues("rank 0: F s0 mb0, BW s0 mb0, REDUCE_GRAD s0, REDUCE_GRAD s0 #1")
    assert twice == ["[once] REDUCE_GRAD s0 runs 2 times; a stage's gradients are reduced once"]


def test_an_action_on_the_wrong_rank_is_a_placement_issue():
    orders = parse_orders("rank 0: F s0 mb0, REDUCE_GRAD s1, BW s0 mb0\nrank 1: F s1 mb0, BW s1 mb0")
    found = [str(i) for i in validate(Schedule("hand", (linear(2),), 1, orders))]
    assert found == ["[placement] rank 0 runs REDUCE_GRAD s1, but the placement puts stage 1 on rank 1"]


def test_lowering_refuses_a_lowered_schedule():
    lowered = add_reduce_grad(build("1f1b", ScheduleSpec(2, 2)))
    with pytest.raises(ScheduleError, match="already lowered"):
        lower(lowered, DataParallel())
    with pytest.raises(ScheduleError, match="gather must be one of none, once, windows"):
        DataParallel(gather="zero3")
    assert add_gathers(build("1f1b", ScheduleSpec(2, 2)), per_run=True, prefetch=0).orders[0][0] == Pass(
        PassKind.UNSHARD, 0, 0
    )


def test_every_action_cost_names_a_per_stage_cost_model_field():
    """``ActionSpec`` names the ``CostModel`` fields it costs: a misspelt one fails only when that kind is timed."""
    per_stage = {f.name for f in fields(CostModel)} - {"pp", "t_comm"}
    for kind, action in SPECS.items():
        named = {*action.time, action.memory, action.frees} - {""}
        assert named <= per_stage, (kind, named - per_stage)
        assert not (action.memory and action.frees), kind  # one memory effect per kind
