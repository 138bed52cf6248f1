"""A fused BW's own time (``CostModel.t_bw``, ``--cost-bw``): 1F1B priced as its backward ran, not as B + W.

On the 2-core CPU the fused backward took less than zb-v's B + W of the same layers, so the planner
predicted a larger gain over 1F1B than the machine gave (docs/bench_runtime.md).
"""

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.schedule import CostModel, ScheduleError, ScheduleSpec, build, simulate
from megatron_zb.schedule.costs_file import MeasuredCosts, load_costs, save_costs
from megatron_zb.schedule.ir import Pass, PassKind
from megatron_zb.schedule.placement import interleaved

P, M = 4, 8


def makespan(name: str, costs: CostModel, chunks: int | None = None) -> float:
    return simulate(build(name, ScheduleSpec(P, M, chunks, costs)), costs).makespan


def test_1f1b_takes_its_closed_form_with_the_fused_time():
    costs = CostModel(P, t_f=1.0, t_b=1.0, t_w=1.0, t_bw=1.5)
    assert makespan("1f1b", costs) == pytest.approx((M + P - 1) * (1.0 + 1.5))
    assert makespan("1f1b", CostModel(P)) == pytest.approx((M + P - 1) * 3.0)  # without it: B + W


def test_without_it_a_bw_costs_exactly_b_plus_w_and_split_schedules_never_see_it():
    plain = CostModel(P, t_f=1.0, t_b=(1.1, 1.2, 1.3, 1.4), t_w=0.7, t_comm=0.05)
    given = CostModel(P, t_f=1.0, t_b=plain.t_b, t_w=0.7, t_comm=0.05, t_bw=[b + 0.7 for b in plain.t_b])
    assert plain.t_bw is None and plain.t_bw_ends is None
    for name, chunks in (("1f1b", None), ("interleaved-1f1b", 2)):
        assert makespan(name, given, chunks) == makespan(name, plain, chunks)
    cheaper = CostModel(P, t_f=1.0, t_b=plain.t_b, t_w=0.7, t_comm=0.05, t_bw=1.0)
    for name in ("zb-h1", "zb-2p", "zb-v"):  # no BW pass: the same plan and time
        assert makespan(name, cheaper) == makespan(name, plain)


def test_a_block_of_an_interleaved_stage_gets_its_share_and_its_ends():
    costs = CostModel(2, t_f=4.0, t_b=4.0, t_w=2.0, t_b_ends=(0.4, 0.8), t_w_ends=(0.2, 0.0), t_bw=5.0)
    placement = interleaved(2, 2)  # blocks 0, 1 hold stage 0's layers, 2, 3 stage 1's; block 0 first, 3 last

    def bw(block: int) -> float:
        return costs.duration(Pass(PassKind.BW, block, 0), placement)

    # derived ends: B's plus W's (0.6, 0.8); stage 0's layers 5 - 0.6 and stage 1's 5 - 0.8, halved per block
    assert [bw(b) for b in range(4)] == pytest.approx([2.2 + 0.6, 2.2, 2.1, 2.1 + 0.8])
    measured = CostModel(2, t_f=4.0, t_b=4.0, t_w=2.0, t_bw=5.0, t_bw_ends=(1.0, 0.0))
    assert [measured.duration(Pass(PassKind.BW, b, 0), placement) for b in range(4)] == pytest.approx(
        [3.0, 2.0, 2.5, 2.5]
    )


def test_derived_ends_never_exceed_the_fused_time():
    costs = CostModel(2, t_b=1.0, t_w=1.0, t_b_ends=(0.8, 0.0), t_w_ends=(0.8, 0.0), t_bw=1.0)
    assert costs.duration(Pass(PassKind.BW, 0, 0), interleaved(2, 2)) == pytest.approx(1.0)  # all of it the end


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"t_bw": -1.0}, "t_bw (--cost-bw) must not be negative"),
        ({"t_bw": (1.0, 2.0, 3.0)}, "t_bw (--cost-bw) has 3 values; give one number or one per stage (pp=2)"),
        ({"t_bw_ends": (0.0, 0.1)}, "t_bw_ends (0.0, 0.1) needs t_bw (--cost-bw), which is not given"),
        ({"t_bw": 1.0, "t_bw_ends": (2.0, 0.0)}, "t_bw_ends: an extra of 2 is more than stage 0's whole time 1"),
        (
            {"t_bw": 0.2, "t_a2a": 0.5},
            "t_a2a_b (--cost-a2a, which gives both directions) of stage 0 is 0.5, more than t_bw (--cost-bw) 0.2 "
            "which includes it (the all-to-alls run inside the BW pass); give at most 0.2",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_flag(fields, message):
    with pytest.raises(ScheduleError) as error:
        CostModel(2, **fields)
    assert message in str(error.value)


def test_a_costs_file_keeps_it_and_an_old_file_has_none(tmp_path):
    costs = CostModel(2, t_f=2.0, t_b=2.0, t_w=1.0, t_bw=(2.5, 2.6), t_bw_ends=(0.1, 0.2))
    save_costs(tmp_path / "fused.json", MeasuredCosts(costs, schedule="1f1b", microbatches=8))
    assert load_costs(tmp_path / "fused.json").costs == costs
    save_costs(tmp_path / "split.json", MeasuredCosts(CostModel(2), schedule="zb-1p", microbatches=8))
    data = json.loads((tmp_path / "split.json").read_text())
    assert "t_bw" not in data["costs"] and load_costs(tmp_path / "split.json").costs.t_bw is None


def test_the_cli_flag_prices_1f1b_and_auto_weighs_it(capsys):
    code = main(["plan", "--pp", "4", "-m", "8", "--schedule", "1f1b", "--cost-bw", "1.5", "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(27.5)
    # A fused backward as cheap as a B alone: 1F1B's family wins auto's ranking; at B + W a zero-bubble one does.
    for fused, family in (("1", "auto (interleaved-1f1b"), (None, "auto (zb-")):
        argv = ["plan", "--pp", "4", "-m", "8", "--schedule", "auto", "--format", "json"]
        code = main(argv + (["--cost-bw", fused] if fused else []))
        chosen = json.loads(capsys.readouterr().out)
        assert code == 0 and chosen["schedule"].startswith(family), chosen["schedule"]
