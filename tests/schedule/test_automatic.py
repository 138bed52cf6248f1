"""Automatic schedules (zb-auto and presets, the V family, auto): the issue's acceptance bounds."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.auto import chunk_counts, messages
from megatron_zb.schedule.generators.greedy import ALL_SWITCHES, greedy_orders
from megatron_zb.schedule.generators.v_family import block_schedule, v_half_offsets, v_min_offsets
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.placement import interleaved, linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import validate


def timeline(name, p, m, costs=None, limit=None):
    schedule = build(name, ScheduleSpec(p, m, costs=costs, memory_limit=limit))
    assert validate(schedule, costs, limit) == []
    return simulate(schedule, costs)


def gpt_costs(p, t_b=1.1, ratio=0.6, comm=0.03, heavy=1.2):
    """Measured GPT stages: T_W/T_B in [0.5, 0.75], T_comm a few % of T_F, embedding/loss stages heavier."""
    scale = [heavy if stage in (0, p - 1) else 1.0 for stage in range(p)]
    return CostModel(p, t_f=scale, t_b=[t_b * x for x in scale], t_w=[t_b * ratio * x for x in scale], t_comm=comm)


@pytest.mark.parametrize("p", [4, 8, 16])
def test_zb_2p_has_no_bubble_from_3p_microbatches(p):
    for m in (3 * p, 4 * p):
        result = timeline("zb-2p", p, m)
        assert result.bubble_rate == 0
        assert max(result.peak_memory) <= 2 * p


@pytest.mark.parametrize("p", [4, 8, 16])
def test_zb_1p_stays_in_1f1b_memory_and_beats_or_ties_zb_h1(p):
    for m in (p, 2 * p, 3 * p):
        result = timeline("zb-1p", p, m)
        assert max(result.peak_memory) <= p
        assert result.bubble_rate <= timeline("zb-h1", p, m).bubble_rate + 1e-12


@pytest.mark.parametrize("p", [4, 8, 16])
def test_zb_v_has_1f1b_memory_and_no_bubble_from_2p_microbatches(p):
    for m in (2 * p, 3 * p):
        result = timeline("zb-v", p, m)
        assert result.bubble_rate == 0
        assert max(result.peak_memory) <= p  # = 2p chunks of half a stage
        assert result.schedule.chunks == 2 and result.schedule.placement.kind == "v"


@pytest.mark.parametrize("p", [4, 6, 8, 16])
def test_v_half_and_v_min_memory_bounds(p):
    for m in (p, 2 * p + 1, 4 * p):
        half, least = timeline("v-half", p, m), timeline("v-min", p, m)
        assert max(half.peak_memory) <= p / 2 + 1
        assert max(least.peak_memory) <= p / 3 + 1
        # the paper's ordering: less memory costs more bubble, all below 1f1b's
        assert least.bubble_rate >= half.bubble_rate - 1e-12
        assert least.bubble_rate < timeline("1f1b", p, m).bubble_rate


@pytest.mark.parametrize("name,offsets", [("v-min", v_min_offsets), ("v-half", v_half_offsets)])
def test_v_blocks_use_real_costs_never_worse_than_the_plain_block(name, offsets):
    costs = gpt_costs(6, t_b=1.3, ratio=0.5, comm=0.05)
    block = block_schedule(name, ScheduleSpec(6, 18, costs=costs), offsets)
    ours = timeline(name, 6, 18, costs)
    plain = simulate(block, costs)
    assert ours.stage_span <= plain.stage_span
    assert max(ours.peak_memory) <= max(plain.peak_memory)


gpt_setting = dict(
    p=st.integers(2, 6),
    m=st.integers(1, 18),
    t_b=st.floats(0.9, 1.4),
    ratio=st.floats(0.5, 0.75),
    comm=st.floats(0.02, 0.05),
)


@settings(max_examples=40, deadline=None)
@given(**gpt_setting)
def test_zb_auto_is_never_worse_than_zb_h1_and_zb_h2_at_their_memory(p, m, t_b, ratio, comm):
    costs = gpt_costs(p, t_b, ratio, comm)
    for limit, handmade in ((p, "zb-h1"), (2 * p, "zb-h2")):
        auto = timeline("zb-auto", p, m, costs, float(limit))
        assert max(auto.peak_memory) <= limit
        assert auto.stage_span <= timeline(handmade, p, m, costs).stage_span + 1e-9


@settings(max_examples=10, deadline=None)
@given(**gpt_setting, low=st.integers(4, 28), more=st.integers(1, 12))
def test_v_auto_bubble_never_grows_with_the_limit(p, m, t_b, ratio, comm, low, more):
    costs = gpt_costs(p, t_b, ratio, comm)
    smaller, larger = low / 4, (low + more) / 4  # limits on the ladder's quarter-stage grid
    larger_span = timeline("v-auto", p, m, costs, larger).stage_span
    assert larger_span <= timeline("v-auto", p, m, costs, smaller).stage_span * (1 + 1e-12)


def test_v_auto_spans_v_min_to_zb_v():
    p, m = 8, 24
    v_min, zb_v = timeline("v-min", p, m), timeline("zb-v", p, m)
    at_min = timeline("v-auto", p, m, limit=max(v_min.peak_memory))
    at_zb_v = timeline("v-auto", p, m, limit=max(zb_v.peak_memory))
    assert at_min.bubble_rate <= v_min.bubble_rate
    assert at_zb_v.bubble_rate == 0


@pytest.mark.parametrize("m", range(1, 8))
def test_zb_auto_with_fewer_microbatches_than_ranks_meets_the_closed_form(m):
    p = 8
    assert timeline("zb-auto", p, m).makespan == 2 * (m + p - 1) + 1  # (m+p-1)(T_F+T_B) + T_W


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_spec_refuses_a_limit_that_is_not_a_positive_number(limit):
    with pytest.raises(ValueError, match=r"memory limit must be a finite number > 0 \(or None for no limit\), got "):
        ScheduleSpec(4, 8, memory_limit=limit)


def test_a_limit_below_any_schedule_names_the_minimum():
    with pytest.raises(ScheduleError) as error:
        build("zb-auto", ScheduleSpec(4, 8, memory_limit=0.5))
    assert str(error.value) == (
        "zb-auto needs --memory-limit >= 1 (one microbatch's activations on every chunk of a rank) for pp=4, got 0.5"
    )
    heavy_first = CostModel(4, mem_f=(2, 1, 1, 1), mem_b=(-1, -0.5, -0.5, -0.5), mem_w=(-1, -0.5, -0.5, -0.5))
    with pytest.raises(ScheduleError, match=r"v-auto needs --memory-limit >= 1.5 "):
        build("v-auto", ScheduleSpec(4, 8, costs=heavy_first, memory_limit=1.2))
    with pytest.raises(ScheduleError, match=r"zb-auto needs --memory-limit >= 2 "):
        build("zb-auto", ScheduleSpec(4, 8, costs=heavy_first, memory_limit=1.5))


@pytest.mark.parametrize("name", ["zb-auto", "v-auto"])
def test_the_minimum_limit_itself_runs(name):
    result = timeline(name, 4, 8, limit=1.0)
    assert max(result.peak_memory) <= 1.0


def candidates(spec: ScheduleSpec):
    """(label, timeline) of every family auto weighs, at each chunk count it takes (1, 2, 4), built alone."""
    for name in names():
        if get(name).composite or get(name).weight_copies > 1:  # auto keeps one copy of the weights
            continue
        many = "chunks" in get(name).options
        for chunks in (1, 2, 4) if many else (None,):
            try:
                schedule = build(name, replace(spec, chunks=chunks), suggest=False)
            except ScheduleError:
                continue
            label = f"{name}, {chunks} chunks" if many and schedule.chunks > 1 else name
            yield label, simulate(schedule, spec.costs)


def test_auto_picks_the_best_schedule_that_fits():
    """Every family at every chunk count it takes, and PyTorch's orders: the shortest makespan wins."""
    p, m, limit = 4, 8, 3.5
    chosen = timeline("auto", p, m, limit=limit)
    others = [
        (other.makespan, other.stage_span, label) for label, other in candidates(ScheduleSpec(p, m, None, None, limit))
    ]
    assert max(chosen.peak_memory) <= limit
    assert (chosen.makespan, chosen.stage_span) <= min(others)[:2]
    assert {label for *_, label in others} >= {"v-half", "v-min", "v-auto", "zb-auto", "zb-auto, 4 chunks"}
    if (chosen.makespan, chosen.stage_span) == min(others)[:2]:
        assert chosen.schedule.name in {
            f"auto ({label})" for *score, label in others if tuple(score) == min(others)[:2]
        }
    else:
        assert chosen.schedule.name.startswith("auto (PyTorch's ")


def test_auto_searches_only_the_chunk_counts_that_split_the_layers():
    spec = ScheduleSpec(4, 8, memory_limit=3.5)
    assert chunk_counts(spec) == (1, 2, 4)
    assert chunk_counts(replace(spec, layers=32)) == (1, 2, 4, 8)
    assert chunk_counts(replace(spec, layers=12)) == (1,)
    assert chunk_counts(replace(spec, chunks=2, layers=12)) == (2,)
    assert build("auto", spec).chunks == 4  # the unconstrained pick
    eight = build("auto", replace(spec, layers=8))
    assert eight.chunks == 2 and eight.placement.num_stages == 8
    twelve = build("auto", replace(spec, layers=12))
    assert twelve.chunks == 1, twelve.name  # neither the V nor 2 or 4 chunks split 12 layers over 4 ranks


def test_auto_explains_when_nothing_fits():
    with pytest.raises(ScheduleError) as error:
        build("auto", ScheduleSpec(4, 8, memory_limit=0.5))
    message = str(error.value)
    assert message.startswith("auto: no schedule can run this setting:")
    assert "  zb-h1: zb-h1 needs --memory-limit >= 4 for pp=4, microbatches=8, got 0.5" in message


def test_searched_schedules_refuse_other_chunk_counts():
    assert build("zb-2p", ScheduleSpec(4, 8, chunks=2)).placement == interleaved(4, 2)
    with pytest.raises(ScheduleError, match="zb-2p runs one chunk per rank, got --chunks 0"):
        build("zb-2p", ScheduleSpec(4, 8, chunks=0))
    with pytest.raises(ScheduleError, match="zb-v runs two chunks per rank .the V., got --chunks 3"):
        build("zb-v", ScheduleSpec(4, 8, chunks=3))


def looping(chunks: int):
    return lambda p: interleaved(p, chunks)


@pytest.mark.parametrize("placement", [linear, v_shape, looping(2), looping(4)], ids=["linear", "v", "loop2", "loop4"])
def test_list_scheduler_never_stalls_at_tight_limits(placement):
    # regression: p=4, m=2 on the V at limit 1 once waited forever with a W that would make room
    for p in range(2, 7):
        costs = gpt_costs(p, t_b=1.25, ratio=0.75, comm=0.03125)
        for m in (1, 2, 3, 5, 8):
            for limit in (1.0, 1.25, 1.5, 2.0):
                for setting in ALL_SWITCHES:
                    result = greedy_orders(placement(p), costs, m, limit, setting)
                    assert result.peak <= limit + 1e-9
                    assert sum(map(len, result.orders)) == 3 * m * p * placement(p).chunks


@pytest.mark.parametrize("post_validation", [False, True])
def test_auto_ranks_by_what_sets_the_iteration_time(post_validation):
    """Makespan when the optimizer ends every iteration; stage span when iterations overlap (post-validation)."""
    costs = CostModel(4, t_f=[1.2, 1, 1, 1.2], t_b=[1.32, 1.1, 1.1, 1.32], t_w=[0.84, 0.7, 0.7, 0.84], t_comm=0.05)
    spec = ScheduleSpec(4, 12, costs=costs, memory_limit=12, post_validation=post_validation)
    chosen = build("auto", spec)
    found = simulate(chosen, costs)
    best = []
    for label, other in candidates(spec):
        key = (other.stage_span, other.makespan) if post_validation else (other.makespan, other.stage_span)
        peak = round(max(other.peak_memory), 9)
        family = label.split(",")[0]
        crossings = messages(other.schedule.placements, 12)
        best.append((round(key[0], 9), round(key[1], 9), peak, crossings, family.endswith("-auto"), label))
        if post_validation:
            assert found.stage_span <= other.stage_span + 1e-9, label
        else:
            assert found.makespan <= other.makespan + 1e-9, label
    assert chosen.name == f"auto ({min(best)[5]})"
