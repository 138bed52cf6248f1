"""The automatic planner against the orders users could pick instead (issue 16).

Realistic costs are uniform stages like the ZB paper's profiles (T_F ~ T_B, T_W/T_B in
[0.5, 0.76], T_comm 1.5-4.5% of T_F, memory F +1, B -0.55, W -0.45); GPT-like costs are
F 1.2 on the first and last stage else 1, B 1.1, W 0.7, comm 0.05 (default memory).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.extend import fewer_microbatches, stretched
from megatron_zb.schedule.generators.result import Result, timed
from megatron_zb.schedule.generators.torch_style import interleaved_zb_orders, zbv_codes
from megatron_zb.schedule.generators.v_blocks import all_blocks, as_passes, block_offsets
from megatron_zb.schedule.generators.v_family import v_half_offsets, v_min_offsets
from megatron_zb.schedule.generators.v_squeeze import squeezed_codes
from megatron_zb.schedule.generators.zb_rounds import ROUND_SWITCHES, NoRoom, round_orders
from megatron_zb.schedule.generators.zbv_rounds import V_ROUND_SWITCHES, RoundRuns, v_round_orders
from megatron_zb.schedule.ir import Pass, Schedule, ScheduleError
from megatron_zb.schedule.placement import interleaved, linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, peak_memory
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import validate

TOLERANCE = 1 + 1e-12


def realistic(p: int, t_b: float, ratio: float, comm: float) -> CostModel:
    return CostModel(p, t_f=1.0, t_b=t_b, t_w=t_b * ratio, t_comm=comm, mem_f=1, mem_b=-0.55, mem_w=-0.45)


def gpt_like(p: int) -> CostModel:
    return CostModel(p, t_f=[1.2 if s in (0, p - 1) else 1.0 for s in range(p)], t_b=1.1, t_w=0.7, t_comm=0.05)


def paper(p: int) -> CostModel:
    """The ZB paper's profile for pp=8, m=24 (T_F 18522, T_B 18086, T_W 9337, T_comm 601)."""
    return CostModel(p, t_f=18522, t_b=18086, t_w=9337, t_comm=601, mem_f=1, mem_b=-0.55, mem_w=-0.45)


costs_of = st.one_of(
    st.builds(
        lambda t_b, ratio, comm: ("realistic", t_b, ratio, comm),
        st.floats(0.95, 1.05),
        st.floats(0.5, 0.76),
        st.floats(0.015, 0.045),
    ),
    st.just(("gpt-like",)),
)


def make(p: int, kind: tuple) -> CostModel:
    return realistic(p, *kind[1:]) if kind[0] == "realistic" else gpt_like(p)


def planned(name: str, p: int, m: int, costs: CostModel, limit: float | None = None):
    schedule = build(name, ScheduleSpec(p, m, costs=costs, memory_limit=limit))
    assert validate(schedule, costs, limit) == []
    return simulate(schedule, costs)


def fits(name: str, p: int, m: int, costs: CostModel, limit: float):
    """The handmade/automatic schedule as its generator makes it, if its peak fits ``limit``."""
    try:
        timeline = planned(name, p, m, costs)
    except ScheduleError:
        return None
    return timeline if max(timeline.peak_memory) <= limit + 1e-9 else None


@settings(max_examples=12, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 16), kind=costs_of, quarters=st.integers(4, 44))
def test_zb_auto_is_never_worse_than_the_handmade_orders_that_fit(p, m, kind, quarters):
    costs, limit = make(p, kind), quarters / 4
    auto = planned("zb-auto", p, m, costs, limit)
    assert max(auto.peak_memory) <= limit + 1e-9
    for handmade in ("1f1b", "zb-h1", "zb-h2"):
        other = fits(handmade, p, m, costs, limit)
        if other is not None:
            assert auto.stage_span <= other.stage_span * TOLERANCE, handmade


@settings(max_examples=8, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 12), kind=costs_of, quarters=st.integers(4, 24))
def test_v_auto_is_never_worse_than_the_v_schedules_that_fit(p, m, kind, quarters):
    costs, limit = make(p, kind), quarters / 4
    auto = planned("v-auto", p, m, costs, limit)
    assert max(auto.peak_memory) <= limit + 1e-9
    for name in ("zb-v", "v-half", "v-min"):
        other = fits(name, p, m, costs, limit)
        if other is not None:
            assert auto.stage_span <= other.stage_span * TOLERANCE, name


@settings(max_examples=8, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 12), kind=costs_of, low=st.integers(4, 20), more=st.integers(1, 8))
def test_v_auto_does_not_grow_with_the_limit(p, m, kind, low, more):
    costs = make(p, kind)
    smaller = planned("v-auto", p, m, costs, low / 4)  # limits on the ladder's quarter-stage grid
    larger = planned("v-auto", p, m, costs, (low + more) / 4)
    assert larger.stage_span <= smaller.stage_span * TOLERANCE


@settings(max_examples=10, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 18), kind=costs_of)
def test_zb_v_is_never_worse_than_the_pytorch_style_zb_v_order(p, m, kind):
    costs = make(p, kind)
    ours = planned("zb-v", p, m, costs)
    theirs = simulate(Schedule("zbv", (v_shape(p),), m, tuple(map(tuple, as_passes(p, m, zbv_codes(p, m))))), costs)
    assert max(ours.peak_memory) <= max(theirs.peak_memory) + 1e-9
    assert ours.stage_span <= theirs.stage_span * TOLERANCE


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 12, 2), (4, 8, 4), (3, 9, 2)])
def test_interleaved_zero_bubble_is_never_worse_than_the_pytorch_style_order(p, m, v):
    for costs in (CostModel(p), gpt_like(p)):
        order = Schedule("izb", (interleaved(p, v),), m, tuple(map(tuple, interleaved_zb_orders(p, m, v))))
        theirs = simulate(order, costs)
        peak = max(theirs.peak_memory)
        ours = simulate(build("zb-auto", ScheduleSpec(p, m, v, costs, peak)), costs)
        assert max(ours.peak_memory) <= peak + 1e-9
        assert ours.stage_span <= theirs.stage_span * TOLERANCE


# The paper's profile at the issue's setting: the reference heuristic (sail-sg, run on the same
# costs and converted to our orders) reaches these stage-span bubbles; ours must not be worse.
REFERENCE_BUBBLES = {"zb-1p": 0.1585, "zb-2p": 0.0433, "zb-v": 0.0703, "v-half": 0.1702}


@pytest.mark.parametrize("name", sorted(REFERENCE_BUBBLES))
def test_the_issue_setting_is_at_least_as_good_as_the_reference(name):
    costs = paper(8)
    assert planned(name, 8, 24, costs).bubble_rate <= REFERENCE_BUBBLES[name] + 5e-5


# Proven optimal by CP-SAT (refine._model solved to OPTIMAL, 2 workers, 3.5 to 4.5 minutes each,
# over every order of the schedule's passes that keeps each stage's microbatches in order) with
# the paper's profile at the schedule's own memory limit (zb-1p: pp, zb-2p: 2pp).
OPTIMA = {
    ("zb-1p", 3, 6): 335_020,
    ("zb-2p", 3, 6): 304_605,
    ("zb-1p", 4, 8): 456_585,
    ("zb-2p", 4, 8): 415_631,
}


@pytest.mark.parametrize("name,p,m", sorted(OPTIMA))
def test_small_cases_are_within_two_percent_of_the_proven_optimum(name, p, m):
    span = planned(name, p, m, paper(p)).stage_span
    assert OPTIMA[name, p, m] <= span <= 1.02 * OPTIMA[name, p, m]


def _as_schedule(result: Result, placement, m: int) -> Schedule:
    return Schedule("candidate", (placement,), m, tuple(map(tuple, result.orders)))


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (3, 7), (4, 12), (6, 5)])
def test_round_heuristics_report_the_simulated_times(p, m):
    costs = gpt_like(p)
    for setting in ROUND_SWITCHES:
        for limit in (None, 2.0 * p, float(p)):
            try:
                result = round_orders(costs, m, limit, setting)
            except NoRoom:
                continue
            schedule = _as_schedule(result, linear(p), m)
            assert validate(schedule, costs, limit) == []
            timeline = simulate(schedule, costs)
            assert (timeline.stage_span, timeline.makespan) == pytest.approx((result.stage_span, result.makespan))
    for setting in V_ROUND_SWITCHES:
        try:
            result = v_round_orders(costs, m, float(p), setting)
        except ScheduleError:
            continue
        schedule = _as_schedule(result, v_shape(p), m)
        assert validate(schedule, costs, float(p)) == []
        assert simulate(schedule, costs).stage_span == pytest.approx(result.stage_span)


def _rounds_or_refusal(plan, *args):
    try:
        return plan(*args).codes
    except ScheduleError as error:
        return type(error)


def test_a_switch_setting_shares_a_run_only_when_that_run_never_read_its_switch():
    shared = distinct = 0
    for p in (3, 4, 6, 8):
        for costs in (gpt_like(p), CostModel(p, t_w=0.2, t_comm=0.2), CostModel(p, 18522, 18086, 9337, 601)):
            for m, limit in ((p, None), (2 * p + 1, float(p)), (3 * p, float(p))):
                runs = RoundRuns(costs, limit)
                for setting in V_ROUND_SWITCHES:
                    direct = _rounds_or_refusal(v_round_orders, costs, m, limit, setting)
                    assert _rounds_or_refusal(runs, m, setting) == direct, (p, m, limit, setting)
                kept = len(runs.runs[m])
                shared, distinct = shared + (kept < len(V_ROUND_SWITCHES)), distinct + (kept > 1)
    assert shared > 0 and distinct > 0  # both sides of the rule were exercised


@pytest.mark.parametrize("p,m", [(16, 128), (24, 96)])
def test_the_rounds_stretched_from_fewer_microbatches_are_the_rounds_for_all(p, m):
    costs = CostModel(p, t_f=18522, t_b=18086, t_w=9337, t_comm=601, mem_f=1, mem_b=-0.55, mem_w=-0.45)
    runs = RoundRuns(costs, float(p))
    for setting in V_ROUND_SWITCHES:
        longer = stretched(lambda n, s=setting: runs(n, s), v_shape(p), costs, m)
        assert runs.runs.keys() == {fewer_microbatches(m, v_shape(p))} != {m}  # planned for fewer only
        assert longer.codes == v_round_orders(costs, m, float(p), setting).codes


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
def test_squeezed_blocks_are_valid_and_keep_the_slot_memory(p):
    costs = CostModel(p)
    for m in (1, p, 2 * p + 1):
        for offsets in (v_half_offsets, v_min_offsets):
            orders = as_passes(p, m, squeezed_codes(p, m, offsets))
            assert validate(Schedule("sq", (v_shape(p),), m, tuple(map(tuple, orders))), costs) == []
        for block in list(all_blocks(p))[:: max(1, len(all_blocks(p)) // 12)]:
            orders = as_passes(p, m, squeezed_codes(p, m, lambda q, r, b=block: b[r]))
            result = timed(orders, v_shape(p), costs, m)
            assert result is not None and validate(_as_schedule(result, v_shape(p), m), costs) == []


def test_squeezed_v_half_matches_the_reference_count():
    # p=4, m=8, unit costs: each rank runs 48 half-stage passes (24 time units) in 53 slots, so the
    # stage span is 26.5 (bubble 5/53 = 9.43%, as the reference's v-half), at the block's peak of 3.
    costs = CostModel(4)
    schedule = Schedule(
        "sq", (v_shape(4),), 8, tuple(map(tuple, as_passes(4, 8, squeezed_codes(4, 8, v_half_offsets))))
    )
    timeline = simulate(schedule, costs)
    assert timeline.stage_span == 26.5
    assert peak_memory(schedule, costs) == 3


def test_a_block_is_the_data_flow_of_its_residues():
    # Rank 0's residues (F0 0, F1 1, B1 2, B0 3), hops of one slot: F0 walks down in slots 0..3, F1
    # turns on rank 3 in the first slot with its residue (1 - 3 = 4 mod 6) and comes back up to rank 0
    # in slot 7, B1 goes down from slot 8 and B0 comes back up from slot 12.
    assert block_offsets(4, (1, 2, 3), 1, 1, 3) == ((0, 7, 8, 15), (1, 6, 9, 14), (2, 5, 10, 13), (3, 4, 11, 12))
    assert block_offsets(4, (2, 4, 5), 1, 1, 3) is None  # rank 1: F0 and F1 both on residue 1


def _torch_orders(name: str, p: int, m: int, per_rank: int) -> tuple:
    """PyTorch's ``pipeline_order`` for a schedule class, built without a process group, as our passes."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    stages = [
        SimpleNamespace(num_stages=p * per_rank, group_size=p, group_rank=0, stage_index=i, submod=None)
        for i in range(per_rank)
    ]
    built = getattr(schedules, name)(stages, m)
    kinds = {schedules.F: "F", schedules.I: "B", schedules.W: "W"}
    return tuple(
        tuple(
            Pass.parse(f"{kinds[a.computation_type]} s{a.stage_index} mb{a.microbatch_index}")
            for a in built.pipeline_order[rank]
            if a is not None
        )
        for rank in range(p)
    )


@pytest.mark.parametrize("p,m", [(2, 1), (2, 5), (4, 3), (4, 8), (4, 13), (6, 12)])
def test_zbv_order_is_pytorchs(p, m):
    assert tuple(map(tuple, as_passes(p, m, zbv_codes(p, m)))) == _torch_orders("ScheduleZBVZeroBubble", p, m, 2)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 4), (3, 9, 3)])
def test_interleaved_zero_bubble_order_is_pytorchs(p, m, v):
    assert tuple(map(tuple, interleaved_zb_orders(p, m, v))) == _torch_orders("ScheduleInterleavedZeroBubble", p, m, v)
