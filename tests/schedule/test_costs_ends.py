"""What the model's ends cost (CostModel.t_f_ends...): the first and last block carry the embedding and the loss.

The V puts both on rank 0. Spread over their stages' blocks, as the per-stage model did, the
plan had rank 0 as light as rank 1 and the runtime waited on it (docs/bench_runtime.md).
"""

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import Pass, PassKind, ScheduleError
from megatron_zb.schedule.placement import interleaved, linear, mirrored, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate

ENDS = CostModel(2, t_f=(10.0, 12.0), t_b=(8.0, 9.0), t_w=(6.0, 6.0), t_f_ends=(1.0, 3.0), t_b_ends=(0.5, 1.0))


def durations(costs: CostModel, placement, kind: PassKind) -> list[float]:
    return [costs.duration(Pass(kind, block, 0), placement) for block in range(placement.num_stages)]


def test_the_first_and_last_block_carry_the_ends_on_any_placement():
    # stage 0's layers take 10 - 1 = 9 (4.5 a block), stage 1's 12 - 3 = 9; block 0 adds 1, block 3 adds 3
    for placement in (v_shape(2), interleaved(2, 2), mirrored(v_shape(2))):
        assert durations(ENDS, placement, PassKind.F) == [5.5, 4.5, 4.5, 7.5]
        assert durations(ENDS, placement, PassKind.B) == [4.25, 3.75, 4.0, 5.0]
        assert durations(ENDS, placement, PassKind.W) == [3.0, 3.0, 3.0, 3.0]
        assert durations(ENDS, placement, PassKind.BW) == [7.25, 6.75, 7.0, 8.0]
    assert durations(ENDS, linear(2), PassKind.F) == [10.0, 12.0]  # a block is its whole stage, ends and all
    assert durations(ENDS, interleaved(2, 3), PassKind.F) == [4.0, 3.0, 3.0, 3.0, 3.0, 6.0]


def test_a_rank_works_what_its_blocks_cost():
    v = v_shape(2)
    assert [ENDS.block_work(b, v) for b in range(4)] == [12.75, 11.25, 11.5, 15.5]
    assert ENDS.has_ends and not CostModel(2, t_f=(10.0, 12.0)).has_ends


def test_without_ends_every_block_costs_its_share_exactly():
    costs = CostModel(3, t_f=(1.1, 1.3, 1.7), t_b=(0.7, 0.9, 1.3), t_w=0.3)
    for placement in (linear(3), interleaved(3, 2), v_shape(3, 2), v_shape(3, 4)):
        for kind in (PassKind.F, PassKind.B, PassKind.W, PassKind.BW):
            stage_time = {PassKind.F: costs.t_f, PassKind.B: costs.t_b, PassKind.W: costs.t_w}
            for block in range(placement.num_stages):
                stage = placement.full_stage(block)
                expected = (
                    (costs.t_b[stage] + costs.t_w[stage]) if kind is PassKind.BW else stage_time[kind][stage]
                ) / placement.chunks
                assert costs.duration(Pass(kind, block, 0), placement) == expected


def test_one_stage_holds_both_ends():
    costs = CostModel(1, t_f=10.0, t_f_ends=(2.0, 4.0))
    assert durations(costs, v_shape(1, 4), PassKind.F) == [3.0, 1.0, 1.0, 5.0]
    with pytest.raises(ScheduleError, match="more than stage 0's whole time"):
        CostModel(1, t_f=5.0, t_f_ends=(2.0, 4.0))


@pytest.mark.parametrize(
    "ends, message",
    [
        ((1.0,), "two numbers"),
        (2.0, "two numbers"),
        ((True, 1.0), "two numbers"),
        ((-1.0, 0.0), "must not be negative"),
        ((0.0, 13.0), "more than stage 1's whole time 12"),
        ((float("nan"), 0.0), "finite"),
    ],
)
def test_ends_are_checked(ends, message):
    with pytest.raises(ScheduleError, match=message):
        CostModel(2, t_f=(10.0, 12.0), t_f_ends=ends)


def test_a_v_planned_with_its_ends_keeps_rank_0_busy():
    # Embedding and loss on rank 0: per microbatch rank 0 works 5.8, rank 1 5.4. Planned with the ends the V
    # spans m times rank 0's work (rank 0 never idles); planned with the ends spread over the stages, it idles.
    true = CostModel(2, t_f=(4.0, 4.4), t_b=4.0, t_w=3.0, t_f_ends=(0.2, 0.6))
    spread = CostModel(2, t_f=true.t_f, t_b=true.t_b, t_w=true.t_w)
    v, m = v_shape(2), 4
    rank_0 = true.block_work(0, v) + true.block_work(3, v)
    assert rank_0 == pytest.approx(11.6) and true.block_work(1, v) + true.block_work(2, v) == pytest.approx(10.8)
    planned = simulate(build("zb-v", ScheduleSpec(2, m, None, true)), true)
    assert planned.makespan == pytest.approx(m * rank_0)
    assert simulate(build("zb-v", ScheduleSpec(2, m, None, spread)), true).makespan == pytest.approx(47.9)


def test_a_costs_file_keeps_the_ends_and_reads_files_without_them(tmp_path):
    from megatron_zb.schedule.costs_file import MeasuredCosts, load_costs, save_costs

    save_costs(tmp_path / "ends.json", MeasuredCosts(ENDS, schedule="zb-v"))
    assert load_costs(tmp_path / "ends.json").costs == ENDS
    plain = CostModel(2, t_f=(10.0, 12.0))
    data = MeasuredCosts(plain).to_dict()
    for name in ("t_f_ends", "t_b_ends", "t_w_ends"):
        del data["costs"][name]  # a file written before the ends
    (tmp_path / "old.json").write_text(__import__("json").dumps(data))
    assert load_costs(tmp_path / "old.json").costs == plain
