"""The expert-parallel all-to-all in the IR: costs, lowering, the dependency rule, validation, pictures, files.

The all-to-all is a part of the F and B passes that already include it (``CostModel.t_a2a``,
``t_a2a_b``); lowering splits it out of them as A2A_F/A2A_B actions, so a schedule without overlap
keeps its makespan and bubble exactly while the all-to-all's share shows in its timeline.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from megatron_zb.cli import main
from megatron_zb.render import render_text
from megatron_zb.render.chrome_trace import render_chrome_trace
from megatron_zb.render.svg import render_svg
from megatron_zb.schedule import (
    CostModel,
    Pass,
    PassKind,
    Schedule,
    ScheduleSpec,
    build,
    messages,
    names,
    simulate,
    validate,
)
from megatron_zb.schedule.costs_file import MeasuredCosts, load_costs, save_costs
from megatron_zb.schedule.ir import ScheduleError, parse_orders
from megatron_zb.schedule.lower import DataParallel, add_all_to_all, lower
from megatron_zb.schedule.placement import linear
from megatron_zb.schedule.serialise import schedule_from_data, schedule_to_data

A2A = (PassKind.A2A_F, PassKind.A2A_B)


def parts(schedule: Schedule, kind: PassKind | None = None) -> list[Pass]:
    return [p for order in schedule.orders for p in order if p.kind in ((kind,) if kind else A2A)]


@pytest.mark.parametrize(
    ("pp", "m", "t_f", "t_b", "t_w", "a2a", "a2a_b"),
    [(4, 8, 1.0, 2.0, 1.0, 0.3, 0.3), (3, 5, 1.5, 1.25, 0.5, 0.5, 0.25), (2, 3, 1.0, 1.0, 1.0, 1.0, 1.0)],
)
def test_1f1b_keeps_its_closed_form_with_the_all_to_all_share_visible(pp, m, t_f, t_b, t_w, a2a, a2a_b):
    costs = CostModel(pp, t_f=t_f, t_b=t_b, t_w=t_w, t_a2a=a2a, t_a2a_b=a2a_b)
    schedule = build("1f1b", ScheduleSpec(pp, m, costs=costs))
    lowered = add_all_to_all(schedule, costs)
    plain, split = simulate(schedule, costs), simulate(lowered, costs)
    assert split.makespan == pytest.approx((m + pp - 1) * (t_f + t_b + t_w))
    assert plain.makespan == pytest.approx(split.makespan)
    assert split.bubble_rate == pytest.approx(plain.bubble_rate)
    assert split.work == pytest.approx((m * (t_f + t_b + t_w),) * pp)
    assert plain.work == pytest.approx(split.work)
    for rank, passes in enumerate(split.ranks):
        kinds = [t.pass_.kind for t in passes]
        assert kinds.count(PassKind.A2A_F) == kinds.count(PassKind.A2A_B) == m, rank
        for before, after in zip(passes, passes[1:], strict=False):
            if before.pass_.kind in A2A:  # the all-to-all, then the rest of its pass, back to back
                assert after.pass_.kind is (PassKind.F if before.pass_.kind is PassKind.A2A_F else PassKind.BW)
                assert (after.pass_.stage, after.pass_.microbatch) == (before.pass_.stage, before.pass_.microbatch)
                assert after.start == before.end
                share = a2a if before.pass_.kind is PassKind.A2A_F else a2a_b
                whole = t_f if before.pass_.kind is PassKind.A2A_F else t_b + t_w
                assert before.end - before.start == pytest.approx(share)
                assert after.end - after.start == pytest.approx(whole - share)
    ends = {(t.pass_.kind, t.pass_.microbatch, r): t.end for r, rank in enumerate(plain.ranks) for t in rank}
    assert ends == {(t.pass_.kind, t.pass_.microbatch, r): t.end for r, rank in enumerate(split.ranks) for t in rank
                    if t.pass_.kind not in A2A}  # fmt: skip


def test_lowering_puts_each_all_to_all_right_before_its_pass_where_the_stage_has_one():
    schedule = build("zb-h1", ScheduleSpec(2, 2))
    lowered = add_all_to_all(schedule, CostModel(2, t_a2a=(0.25, 0.0)))  # stage 1 has no MoE layer
    assert lowered.to_text() == (
        "rank 0: A2A_F s0 mb0, F s0 mb0, A2A_F s0 mb1, F s0 mb1, A2A_B s0 mb0, B s0 mb0, W s0 mb0, A2A_B s0 mb1, "
        "B s0 mb1, W s0 mb1\n"
        "rank 1: F s1 mb0, B s1 mb0, F s1 mb1, B s1 mb1, W s1 mb0, W s1 mb1"
    )
    assert validate(lowered) == []
    assert add_all_to_all(schedule, CostModel(2)) is schedule  # no all-to-all: nothing to split
    assert parse_orders(lowered.to_text()) == lowered.orders
    assert schedule_from_data(schedule_to_data(lowered)) == lowered
    with pytest.raises(ScheduleError, match="already has its all-to-alls split"):
        add_all_to_all(lowered, CostModel(2, t_a2a=0.25))


def test_only_the_direction_with_time_is_split_and_messages_do_not_change():
    schedule = build("zb-1p", ScheduleSpec(3, 6))
    backward_only = add_all_to_all(schedule, CostModel(3, t_a2a=0.0, t_a2a_b=0.5))
    assert parts(backward_only, PassKind.A2A_F) == [] and len(parts(backward_only, PassKind.A2A_B)) == 3 * 6
    assert messages(backward_only) == messages(schedule)  # the pass receives and sends, never its all-to-all


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b", "zb-2p", "bitpipe-zb"])
def test_every_placement_keeps_its_makespan_with_data_parallel_lowering_too(name):
    costs = CostModel(4, t_f=(1.0, 1.2, 1.0, 1.4), t_b=1.5, t_w=0.8, t_comm=0.1, t_dp=0.3, t_a2a=(0.2, 0.4, 0.0, 0.6))
    schedule = build(name, ScheduleSpec(4, 8, costs=costs))
    chunks = schedule.placements[0].chunks  # blocks per stage a microbatch runs (one pipe)
    for data_parallel in (DataParallel(reduce_grad=False), DataParallel(gather="windows")):
        plain = simulate(lower(schedule, data_parallel), costs)
        split = lower(schedule, data_parallel, costs)
        assert validate(split) == []
        assert len(parts(split)) == 2 * 8 * 3 * chunks  # F and B (BW) of 3 stages of 4 have all-to-alls
        timeline = simulate(split, costs)
        assert timeline.makespan == pytest.approx(plain.makespan)
        assert timeline.stage_span == pytest.approx(plain.stage_span)


def test_the_validator_names_a_misplaced_or_repeated_all_to_all():
    base = "rank 0: A2A_F s0 mb0, F s0 mb0, A2A_B s0 mb0, BW s0 mb0\nrank 1: F s1 mb0, BW s1 mb0"
    assert validate(Schedule("ok", (linear(2),), 1, parse_orders(base))) == []
    late = base.replace("A2A_F s0 mb0, F s0 mb0", "F s0 mb0, A2A_F s0 mb0")
    [issue] = validate(Schedule("late", (linear(2),), 1, parse_orders(late)))
    assert (issue.rule, issue.pass_) == ("order", Pass(PassKind.F, 0, 0))
    assert "before its input A2A_F s0 mb0" in issue.message
    twice = base.replace("A2A_B s0 mb0,", "A2A_B s0 mb0, A2A_B s0 mb0,")
    assert [i.rule for i in validate(Schedule("twice", (linear(2),), 1, parse_orders(twice)))] == ["once"]
    elsewhere = base.replace("rank 1: F s1 mb0", "rank 1: A2A_F s0 mb0, F s1 mb0")
    rules = {i.rule for i in validate(Schedule("elsewhere", (linear(2),), 1, parse_orders(elsewhere)))}
    assert "placement" in rules
    outside = base.replace("A2A_B s0 mb0", "A2A_B s0 mb4")
    assert {i.rule for i in validate(Schedule("outside", (linear(2),), 1, parse_orders(outside)))} == {"range"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(t_a2a=1.5), r"t_a2a \(--cost-a2a\) of stage 0 is 1.5, more than t_f \(--cost-f\) 1 .*give at most 1"),
        (dict(t_a2a=0.5, t_a2a_b=(0.5, 2.0)), r"t_a2a_b \(--cost-a2a, which gives both directions\) of stage 1 .* "
                                                r"t_b \(--cost-b\) 1 .*inside the B pass"),
        (dict(t_a2a=0.5, t_f_ends=(0.6, 0.0)), r"less the ends' extra \(t_f_ends\), 0.4, .*give at most 0.4"),
        (dict(t_a2a=-0.1), r"t_a2a \(--cost-a2a\) must not be negative"),
        (dict(t_a2a=(0.1, 0.2, 0.3)), r"t_a2a \(--cost-a2a\) has 3 values"),
    ],
)  # fmt: skip
def test_bad_all_to_all_costs_are_refused_naming_the_flag(fields, message):
    with pytest.raises(ScheduleError, match=message):
        CostModel(2, **fields)


def test_costs_file_keeps_both_directions_and_old_files_read_as_none(tmp_path):
    costs = CostModel(2, t_f=3.0, t_b=4.0, t_a2a=(0.5, 0.0), t_a2a_b=(0.75, 0.0))
    path = tmp_path / "costs.json"
    save_costs(path, MeasuredCosts(costs, schedule="zb-1p", microbatches=4))
    assert load_costs(path).costs == costs
    data = json.loads(path.read_text())
    for name in ("t_a2a", "t_a2a_b"):
        del data["costs"][name]
    path.write_text(json.dumps(data))
    assert load_costs(path).costs.t_a2a == load_costs(path).costs.t_a2a_b == (0.0, 0.0)


def test_pictures_draw_the_all_to_all_in_the_rank_row():
    costs = CostModel(2, t_a2a=0.5)
    timeline = simulate(add_all_to_all(build("1f1b", ScheduleSpec(2, 2)), costs), costs)
    text = render_text(timeline)
    row = text.splitlines()[0]
    assert row.startswith("rank 0 |a0F0") and "A0BW0" in row
    assert "a3 expert-parallel all-to-all (dispatch + combine) of F3 | A3 of B3 (or BW3)" in text
    svg = ET.fromstring(render_svg(timeline))
    rects = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if "A2A" in r.get("class")]
    assert len(rects) == 2 * 2 * 2
    assert "A2A_F all-to-all fwd" in {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    events = [e for e in render_chrome_trace(timeline)["traceEvents"] if e.get("cat") == "A2A_B"]
    assert sorted((e["tid"], e["name"], e["dur"]) for e in events) == [
        (0, "A2A_B mb0", 500.0), (0, "A2A_B mb1", 500.0), (1, "A2A_B mb0", 500.0), (1, "A2A_B mb1", 500.0),
    ]  # fmt: skip
    [action] = [a for a in timeline.to_dict()["ranks"][1] if a["pass"] == "A2A_F" and a["microbatch"] == 1]
    assert (action["stream"], action["end"] - action["start"]) == ("expert", 0.5)


def test_plan_takes_an_expert_parallel_cost_and_names_the_actions(capsys):
    argv = ["plan", "--schedule", "zb-1p", "--pp", "4", "--microbatches", "8"]
    assert main([*argv, "--format", "json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--cost-a2a", "0.2", "--format", "json"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["makespan"] == pytest.approx(plain["makespan"])
    assert split["bubble_rate"] == pytest.approx(plain["bubble_rate"])
    for rank in split["ranks"]:
        a2a = [(a["pass"], a["microbatch"]) for a in rank if a["pass"] in ("A2A_F", "A2A_B")]
        assert sorted(a2a) == sorted((kind, mb) for kind in ("A2A_F", "A2A_B") for mb in range(8))
    assert main([*argv, "--cost-a2a", "0.2"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("rank 0 |a0F0") and "expert-parallel all-to-all" in text
    assert main([*argv, "--cost-a2a", "1.5"]) == 2
    assert "t_a2a (--cost-a2a) of stage 0 is 1.5, more than t_f (--cost-f) 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", names())
def test_planners_plan_the_same_schedule_with_all_to_all_costs(name):
    """The all-to-all is inside t_f and t_b: a planner of compute passes must plan exactly as without it."""
    times = dict(t_f=(1.0, 1.0, 0.5, 0.5), t_b=(1.0, 1.0, 0.5, 0.5), t_w=0.5)
    try:
        plain = build(name, ScheduleSpec(4, 8, costs=CostModel(4, **times)))
    except ScheduleError:
        pytest.skip(f"{name} does not run pp=4, m=8")
    with_a2a = build(name, ScheduleSpec(4, 8, costs=CostModel(4, **times, t_a2a=(0.9, 0.9, 0.4, 0.4))))
    assert with_a2a.orders == plain.orders
