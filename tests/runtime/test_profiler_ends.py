"""The profiler measures what the ends add, from a placement with several blocks per stage (end_extras)."""

import pytest

from megatron_zb.runtime.profiler import end_extras
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import Pass, PassKind
from megatron_zb.schedule.registry import ScheduleSpec, build

TRUE = CostModel(2, t_f=(10.0, 12.0), t_b=(8.0, 9.0), t_w=(6.0, 7.0), t_f_ends=(1.0, 3.0), t_b_ends=(0.5, 1.0))
PER_STAGE = {"t_f": TRUE.t_f, "t_b": TRUE.t_b, "t_w": TRUE.t_w}


def block_sums(schedule, kinds=("F", "B", "W"), count=3) -> dict:
    """What ``profiler.block_sums`` adds up over every rank when each pass takes what ``TRUE`` says."""
    placement = schedule.placement
    return {
        (kind, block): (count * TRUE.duration(Pass(PassKind(kind), block, 0), placement), count)
        for kind in kinds
        for block in range(placement.num_stages)
    }


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b"])
def test_the_ends_come_back_from_the_blocks_times(name):
    schedule = build(name, ScheduleSpec(2, 4, 2))
    found = end_extras(block_sums(schedule), schedule, PER_STAGE)
    assert found == {"t_f_ends": (1.0, 3.0), "t_b_ends": (0.5, 1.0), "t_w_ends": (0.0, 0.0)}
    assert CostModel(2, *PER_STAGE.values(), **found) == TRUE


def test_a_fused_backward_is_split_like_the_stage_costs():
    schedule = build("interleaved-1f1b", ScheduleSpec(2, 4, 2))
    sums = block_sums(schedule, kinds=("F", "BW"))
    found = end_extras(sums, schedule, PER_STAGE, w_share_when_fused=0.25)
    assert found["t_f_ends"] == (1.0, 3.0)
    assert found["t_b_ends"] == pytest.approx((0.375, 0.75)) and found["t_w_ends"] == pytest.approx((0.125, 0.25))


def test_one_block_per_stage_measures_no_ends():
    schedule = build("zb-h1", ScheduleSpec(2, 4))
    sums = {(kind, block): (5.0 + block, 1) for kind in ("F", "B", "W") for block in range(2)}
    assert set(end_extras(sums, schedule, PER_STAGE).values()) == {(0.0, 0.0)}


def test_an_end_measured_faster_than_its_neighbours_adds_nothing():
    schedule = build("zb-v", ScheduleSpec(2, 4))
    sums = block_sums(schedule)
    sums[("F", 0)] = (3 * 4.0, 3)  # block 0 below block 1's 4.5: noise, not a negative embedding
    assert end_extras(sums, schedule, PER_STAGE)["t_f_ends"] == (0.0, 3.0)


def test_a_fused_backwards_own_ends_are_measured_where_it_ran():
    schedule = build("interleaved-1f1b", ScheduleSpec(2, 4, 2))
    per_stage = {**PER_STAGE, "t_bw": tuple(b + w for b, w in zip(TRUE.t_b, TRUE.t_w, strict=True))}
    found = end_extras(block_sums(schedule, kinds=("F", "BW")), schedule, per_stage)
    assert found["t_bw_ends"] == pytest.approx((0.5, 1.0))  # B's and W's extras: what TRUE prices a BW with
    assert "t_bw_ends" not in end_extras(block_sums(schedule), schedule, per_stage)  # no BW ran: none measured
