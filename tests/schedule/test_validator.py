"""The validator rejects hand-broken schedules and names the culprit."""

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import Schedule, ScheduleError, parse_orders
from megatron_zb.schedule.placement import linear
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.validate import check, validate

ZB_H1_2x2 = """
rank 0: F s0 mb0, F s0 mb1, B s0 mb0, W s0 mb0, B s0 mb1, W s0 mb1
rank 1: F s1 mb0, B s1 mb0, F s1 mb1, B s1 mb1, W s1 mb0, W s1 mb1
"""


def schedule(text, m=2):
    orders = parse_orders(text)
    return Schedule("hand", (linear(len(orders)),), m, orders)


def edited(old, new):
    return schedule(ZB_H1_2x2.replace(old, new))


def only_issue(s, **kwargs):
    issues = validate(s, **kwargs)
    assert len(issues) == 1, issues
    return issues[0]


def test_the_unbroken_schedule_is_valid_and_is_what_zb_h1_generates():
    assert validate(schedule(ZB_H1_2x2)) == []
    assert build("zb-h1", ScheduleSpec(2, 2)).orders == schedule(ZB_H1_2x2).orders


def test_missing_w():
    issue = only_issue(edited("B s1 mb1, W s1 mb0,", "B s1 mb1,"))
    assert issue.rule == "missing" and issue.rank == 1
    assert issue.message == "missing W s1 mb0: rank 1 never runs it"


def test_b_before_its_f():
    issue = only_issue(edited("F s0 mb0, F s0 mb1, B s0 mb0,", "B s0 mb0, F s0 mb0, F s0 mb1,"))
    assert issue.rule == "order" and issue.rank == 0 and str(issue.pass_) == "B s0 mb0"
    assert issue.message == "rank 0 runs B s0 mb0 (pass 0) before its input F s0 mb0 (pass 1)"


def test_cross_rank_deadlock_names_the_cycle_and_each_wait():
    s = schedule(
        """
        rank 0: F s0 mb0, B s0 mb0, F s0 mb1, W s0 mb0, B s0 mb1, W s0 mb1
        rank 1: F s1 mb0, F s1 mb1, B s1 mb0, B s1 mb1, W s1 mb0, W s1 mb1
        """
    )
    issue = only_issue(s)
    assert issue.rule == "deadlock" and issue.rank == 0
    lines = issue.message.splitlines()
    assert lines[0] == "deadlock: ranks 0 -> 1 -> 0 wait on each other"
    assert lines[1:] == [
        "  rank 0 waits at pass 1 (B s0 mb0) for B s1 mb0 (rank 1)",
        "  rank 1 waits at pass 1 (F s1 mb1) for F s0 mb1 (rank 0)",
    ]


def test_memory_over_limit():
    s = build("zb-h2", ScheduleSpec(2, 4))
    issue = only_issue(s, memory_limit=2)
    assert issue.rule == "memory" and issue.rank == 0 and str(issue.pass_) == "F s0 mb2"
    assert issue.message.startswith("rank 0 holds 3 microbatch-stages of activations after F s0 mb2 (pass 2)")
    assert "over the memory limit 2; this rank peaks at 3" in issue.message
    assert validate(s, memory_limit=3) == []
    half_cheaper = CostModel(2, mem_f=0.5, mem_b=-0.25, mem_w=-0.25)
    assert validate(s, half_cheaper, memory_limit=1.5) == []


def test_pass_run_twice():
    issue = only_issue(edited("W s0 mb1", "W s0 mb1, W s0 mb1"))
    assert issue.rule == "once" and issue.message == "rank 0 runs W s0 mb1 2 times"


def test_fused_and_split_backward_for_one_microbatch():
    issues = validate(edited("W s1 mb1", "W s1 mb1, BW s1 mb1"))
    assert [i.message for i in issues] == ["rank 1 runs B s1 mb1 2 times", "rank 1 runs W s1 mb1 2 times"]


def test_pass_on_the_wrong_rank():
    issue = only_issue(edited("rank 0: F s0 mb0,", "rank 0: F s1 mb0,"))
    assert issue.rule == "placement"
    assert issue.message == "rank 0 runs F s1 mb0, but the placement puts stage 1 on rank 1"


def test_microbatch_out_of_range():
    issue = only_issue(edited("W s1 mb1", "W s1 mb2"), memory_limit=10)
    assert issue.rule == "range" and "microbatch outside 0..1" in issue.message


def test_check_raises_with_every_issue():
    with pytest.raises(ScheduleError) as error:
        check(edited("B s1 mb1, W s1 mb0, W s1 mb1", "B s1 mb1"))
    text = str(error.value)
    assert text.splitlines()[0] == "schedule hand (pp=2, microbatches=2) is invalid:"
    assert "missing W s1 mb0" in text and "missing W s1 mb1" in text
