"""The idle-time breakdown on synthetic traces with known waits and overheads (closed numbers).

Unit costs at pp=2 and two microbatches: the simulated timelines are printed in the comments,
so every expected number can be checked by hand. Times are multiples of 1/4 (exact floats).
"""

from __future__ import annotations

import json

import pytest

from megatron_zb.runtime.profiler import CallRecord, PassRecord, stage_sums
from megatron_zb.schedule import CostModel, ScheduleSpec, build, simulate
from megatron_zb.schedule.ir import BW, B, F, W
from megatron_zb.schedule.lower import DataParallel, lower
from megatron_zb.training import idle

UNIT = CostModel(2, (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), 0.0)
# 1f1b rank 0: F mb0 0-1, F mb1 1-2, BW mb0 4-6, BW mb1 7-9   (idle 2 before BW mb0, 1 before BW mb1)
ONE_F_ONE_B = build("1f1b", ScheduleSpec(2, 2, costs=UNIT))
# zb-h1 rank 0: F mb0 0-1, F mb1 1-2, B mb0 3-4, W mb0 4-5, B mb1 5-6, W mb1 6-7
ZB_H1 = build("zb-h1", ScheduleSpec(2, 2, costs=UNIT))


def rec(p, start: float, end: float, waited: float = 0.0, iteration: int = 1) -> PassRecord:
    return PassRecord(iteration, p, 0, start, end, waited)


def test_planned_gaps_are_the_simulated_idle_before_each_pass():
    timeline = simulate(ONE_F_ONE_B, UNIT)
    assert idle.planned_gaps(timeline, 0) == {F(0, 0): 0.0, F(0, 1): 0.0, BW(0, 0): 2.0, BW(0, 1): 1.0}
    # rank 1: F mb0 1-2, BW mb0 2-4, F mb1 4-5, BW mb1 5-7: it waits 1 for its first input
    assert idle.planned_gaps(timeline, 1) == {F(1, 0): 1.0, BW(1, 0): 0.0, F(1, 1): 0.0, BW(1, 1): 0.0}


def test_prediction_is_compute_and_planned_wait_only():
    timeline = simulate(ONE_F_ONE_B, UNIT)
    assert idle.predicted(timeline, 0) == idle.IdleBreakdown(9.0, 6.0, 3.0, 0.0, 0.0, 0.0, 0.0)
    assert idle.predicted(timeline, 1) == idle.IdleBreakdown(7.0, 6.0, 1.0, 0.0, 0.0, 0.0, 0.0)


def test_an_all_to_all_split_out_of_its_pass_leaves_the_gaps_and_the_prediction_as_they_were():
    """With expert-parallel all-to-all time (``--cost-a2a``) lowering splits it out of each F and BW; at run time it
    runs inside the pass, so the wait before it is that pass's and its time is compute."""
    moe = CostModel(2, (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), 0.0, t_a2a=0.25)
    timeline = simulate(lower(ONE_F_ONE_B, DataParallel(reduce_grad=False), moe), moe)
    assert {t.pass_.kind.value for t in timeline.ranks[0]} == {"A2A_F", "F", "A2A_B", "BW"}
    assert idle.planned_gaps(timeline, 0) == {F(0, 0): 0.0, F(0, 1): 0.0, BW(0, 0): 2.0, BW(0, 1): 1.0}
    assert idle.predicted(timeline, 1) == idle.IdleBreakdown(7.0, 6.0, 1.0, 0.0, 0.0, 0.0, 0.0)


def test_measured_waits_split_at_the_plan_and_parts_add_up_to_idle():
    gaps = idle.planned_gaps(simulate(ONE_F_ONE_B, UNIT), 0)
    # Span 12 from 100: F 1 + 1.25, BW 2 + 2 (compute 6.25). Before BW mb0 the rank waits 3 where the
    # plan idles 2 (1 unplanned); before BW mb1 it waits 0.5 of a planned 1; F mb1 waits 0.25 though
    # the plan said its input would be there. Posting and the last sends take 0.75.
    records = [
        rec(F(0, 0), 100.0, 101.0),
        rec(F(0, 1), 101.5, 102.75, waited=0.25),
        rec(BW(0, 0), 106.0, 108.0, waited=3.0),
        rec(BW(0, 1), 109.5, 111.5, waited=0.5),
        rec(F(0, 0), 0.0, 50.0, iteration=2),  # another iteration: ignored
    ]
    found = idle.measured(records, CallRecord(1, 100.0, 112.0, 0.75), gaps)
    assert found == idle.IdleBreakdown(
        span=12.0, compute=6.25, planned_wait=2.5, unplanned_wait=1.25, send_recv=0.75, python=1.25, w_split=None
    )
    assert found.idle == 5.75
    assert found.planned_wait + found.unplanned_wait + found.send_recv + found.python == found.idle


def test_w_split_is_b_plus_w_beyond_the_fused_backward():
    # The 1F1B run's fused BW: 2.0 on stage 0 (both microbatches), so B + W = 1.25 + 1.0 costs 0.25 more.
    reference = [rec(BW(0, 0), 0.0, 2.0), rec(BW(0, 1), 3.0, 5.0), rec(BW(1, 0), 0.0, 3.0), rec(BW(1, 1), 0.0, 3.0)]
    fused = idle.fused_backward(stage_sums(reference, ONE_F_ONE_B), ONE_F_ONE_B)
    assert fused == (2.0, 3.0)
    gaps = idle.planned_gaps(simulate(ZB_H1, UNIT), 0)  # F 0, F 0, B 1, W 0, B 0, W 0
    records = [
        rec(F(0, 0), 0.0, 1.0),
        rec(F(0, 1), 1.0, 2.0),
        rec(B(0, 0), 3.5, 4.75, waited=1.5),
        rec(W(0, 0), 4.75, 5.75),
        rec(B(0, 1), 5.75, 7.0),
        rec(W(0, 1), 7.0, 8.0),
    ]
    found = idle.measured(records, CallRecord(1, 0.0, 8.5, 0.25), gaps, ZB_H1, fused)
    assert found == idle.IdleBreakdown(8.5, 6.5, 1.0, 0.5, 0.25, 0.25, 0.5)


def test_w_split_of_a_v_placement_counts_half_a_stage_per_chunk():
    zb_v = build("zb-v", ScheduleSpec(2, 2, costs=UNIT))  # rank 0 runs stages 0 and 3: half a full stage each
    records = [rec(B(0, 0), 0.0, 0.75), rec(W(0, 0), 0.75, 1.5), rec(B(3, 0), 2.0, 3.0), rec(W(3, 0), 3.0, 3.5)]
    # 1.5 - 2.0/2 on stage 0 (full stage 0), 1.5 - 3.0/2 on stage 3 (full stage 1)
    assert idle.w_split(records, zb_v, (2.0, 3.0)) == 0.5


def test_fused_backward_needs_every_stage():
    with pytest.raises(ValueError, match="no fused BW pass of stage 1 in the records of 1f1b"):
        idle.fused_backward(stage_sums([rec(BW(0, 0), 0.0, 2.0)], ONE_F_ONE_B), ONE_F_ONE_B)


def test_mean_is_field_wise():
    a = idle.IdleBreakdown(4.0, 2.0, 1.0, 0.5, 0.25, 0.25, 0.5)
    b = idle.IdleBreakdown(6.0, 3.0, 2.0, 0.5, 0.25, 0.25, None)
    assert idle.mean([a, a]) == a
    assert idle.mean([a, b]) == idle.IdleBreakdown(5.0, 2.5, 1.5, 0.5, 0.25, 0.25, None)
    with pytest.raises(ValueError, match="no breakdowns to average"):
        idle.mean([])


class _Profiler:
    def __init__(self, records, calls):
        self.records, self.calls = records, calls


def test_launcher_row_scales_the_plan_to_the_measured_compute():
    # Every pass took 2 units where the unit-cost plan says 1: the plan (span 7, compute 6, wait 1 before B mb0)
    # is scaled by 2, so the 1.5 waited before B mb0 is all planned.
    records = [
        rec(F(0, 0), 0.0, 2.0),
        rec(F(0, 1), 2.0, 4.0),
        rec(B(0, 0), 5.5, 7.5, waited=1.5),
        rec(W(0, 0), 7.5, 9.5),
        rec(B(0, 1), 9.5, 11.5),
        rec(W(0, 1), 11.5, 13.5),
    ]
    profiler = _Profiler(records, [CallRecord(0, 0.0, 1.0, 0.0), CallRecord(1, 0.0, 14.5, 0.5)])
    row = idle.of_iteration(profiler, ZB_H1, 0, 1)
    assert row == {
        "measured": idle.IdleBreakdown(14.5, 12.0, 1.5, 0.0, 0.5, 0.5).to_dict(),
        "predicted": idle.IdleBreakdown(14.0, 12.0, 2.0, 0.0, 0.0, 0.0, 0.0).to_dict(),
    }
    assert idle.of_iteration(profiler, ZB_H1, 0, 2) is None


def test_summary_shows_the_breakdown_in_ms(tmp_path):
    from megatron_zb.training import summary

    breakdown = {
        "measured": idle.IdleBreakdown(1.0, 0.75, 0.125, 0.0625, 0.03125, 0.03125).to_dict(),
        "predicted": idle.IdleBreakdown(0.875, 0.75, 0.125, 0.0, 0.0, 0.0, 0.0).to_dict(),
    }
    path = tmp_path / "zb-v.jsonl"
    rows = [
        {
            "iteration": i,
            "loss": 2.0,
            "iteration_time_s": 1.0,
            "bubble_rate": 0.1,
            "schedule": "zb-v",
            "idle": breakdown,
        }
        for i in (1, 2)
    ]
    path.write_text("\n".join(map(json.dumps, rows)))
    lines = summary.summarize([path]).splitlines()
    cells = lines[-2].replace("(", " ").replace(")", " ").split()
    measured_planned = "1000.0 875.0 750.0 750.0 125.0 125.0 62.5 0.0 31.2 0.0 31.2 0.0".split()
    assert cells == ["zb-v", *measured_planned]
