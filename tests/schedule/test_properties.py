"""Every generator's output passes the validator for all pp <= 16, m <= 64 (hypothesis),
and settings a generator cannot run are refused with a message naming them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.schedule.generators.interleaved import group_sizes
from megatron_zb.schedule.ir import PassKind, ScheduleError
from megatron_zb.schedule.registry import ScheduleSpec, build, names
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import validate

# (accepts(p, m, chunks), peak memory bound in stages, the refusal message for the rest)
RULES = {
    "1f1b": (lambda p, m, v: v == 1, lambda p, m, v: min(p, m), "runs one chunk per rank"),
    "zb-h1": (lambda p, m, v: v == 1, lambda p, m, v: min(p, m), "runs one chunk per rank"),
    "zb-h2": (lambda p, m, v: v == 1, lambda p, m, v: min(2 * p - 1, m), "runs one chunk per rank"),
    "interleaved-1f1b": (
        lambda p, m, v: v >= 2,
        lambda p, m, v: min(2 * (p - 1) + (v - 1) * group_sizes(m, p)[0] + 1, m * v) / v,
        "needs",
    ),
    "zb-auto": (lambda p, m, v: True, lambda p, m, v: m, ""),  # --chunks v >= 2: the looping placement
    "zb-1p": (lambda p, m, v: True, lambda p, m, v: min(p, m), ""),
    "zb-2p": (lambda p, m, v: True, lambda p, m, v: min(2 * p, m), ""),
    "zb-v": (lambda p, m, v: v == 2, lambda p, m, v: min(p, m), "runs two chunks per rank"),
    "v-half": (lambda p, m, v: v == 2, lambda p, m, v: p / 2 + 1, "runs two chunks per rank"),
    "v-min": (lambda p, m, v: v == 2, lambda p, m, v: p / 3 + 1, "runs two chunks per rank"),
    "v-auto": (lambda p, m, v: v == 2, lambda p, m, v: m, "runs two chunks per rank"),
    "auto": (lambda p, m, v: True, lambda p, m, v: m, ""),
    # one breadth-first group of all m microbatches: a rank holds all of them (GPipe at v=1)
    "breadth-first": (lambda p, m, v: True, lambda p, m, v: m, ""),
    "breadth-first-zb": (lambda p, m, v: True, lambda p, m, v: m, ""),
    # two mirrored V pipes, four chunks per rank; 1F1B's memory, more for the split one's deferred Ws
    "bitpipe": (lambda p, m, v: p % 2 == 0 and m % p == 0 and v == 4, lambda p, m, v: p, "needs|runs four chunks"),
    "bitpipe-zb": (lambda p, m, v: p % 2 == 0 and m % p == 0 and v == 4, lambda p, m, v: m, "needs|runs four chunks"),
}
SEARCHED = {"zb-auto", "zb-1p", "zb-2p", "zb-v", "v-half", "v-min", "v-auto", "auto"}  # slower: smaller sizes


def test_every_registered_schedule_has_a_rule():
    assert sorted(RULES) == names()


@pytest.mark.parametrize("name", sorted(RULES))
@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 16), m=st.integers(1, 64), v=st.integers(1, 4))
def test_generated_schedules_are_valid_or_refused(name, p, m, v):
    accepts, peak_bound, refusal = RULES[name]
    if name in SEARCHED:
        p, m = min(p, 8), min(m, 24)
    spec = ScheduleSpec(p, m, v)
    if not accepts(p, m, v):
        with pytest.raises(ScheduleError, match=refusal):
            build(name, spec)
        return
    schedule = build(name, spec)
    assert validate(schedule) == []
    fused = any(p.kind is PassKind.BW for order in schedule.orders for p in order)
    assert sum(len(order) for order in schedule.orders) == m * schedule.num_stages() * (2 if fused else 3)
    if name != "auto":
        assert fused == (name in ("1f1b", "interleaved-1f1b", "breadth-first", "bitpipe"))
    timeline = simulate(schedule)
    assert max(timeline.peak_memory) <= peak_bound(p, m, v) + 1e-9
    assert -1e-12 <= timeline.bubble_rate <= timeline.bubble_rate_makespan + 1e-12 < 1 + 1e-12  # float sums


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_runs_any_microbatch_count(p: int, v: int) -> None:
    """No short last group: every m validates; groups are pp when pp divides m, PyTorch's rounds otherwise."""
    for m in range(1, 5 * p + 2):
        build("interleaved-1f1b", ScheduleSpec(p, m, v))  # validated: no deadlock
        groups = group_sizes(m, p)
        assert sum(groups) == m and min(groups) >= min(m, p), (m, groups)
        rounds = max(1, m // p)  # torch.distributed.pipelining.ScheduleInterleaved1F1B, when it accepts m
        if m % rounds == 0:
            assert groups == [m // rounds] * rounds, (m, groups)


def test_interleaved_with_uneven_groups_warms_up_one_group_deep() -> None:
    """p=4, m=6 (one group of 6, as PyTorch): rank 3 runs all chunk-0 forwards before its first backward."""
    schedule = build("interleaved-1f1b", ScheduleSpec(4, 6, 2))
    assert [str(x) for x in schedule.orders[3][:8]] == [
        *(f"F s3 mb{mb}" for mb in range(6)),
        "F s7 mb0",
        "BW s7 mb0",
    ]
    with pytest.raises(ScheduleError, match="needs --chunks >= 2, got 1; with one chunk use 1f1b"):
        build("interleaved-1f1b", ScheduleSpec(4, 8, 1))


def test_unknown_schedule_and_bad_sizes():
    with pytest.raises(ScheduleError, match=f"unknown schedule .zb-h3.; known: {', '.join(names())}"):
        build("zb-h3", ScheduleSpec(4, 8))
    with pytest.raises(ScheduleError, match="microbatches must be at least 1, got 0"):
        build("1f1b", ScheduleSpec(4, 0))
