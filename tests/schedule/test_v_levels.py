"""v-auto's building-block candidates: reordering, stretching a steady state, polishing, the peak
of a repeated block, and v-auto against the reference implementation's adaptive V scheduler."""

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.extend import extended
from megatron_zb.schedule.generators.polish import polish
from megatron_zb.schedule.generators.result import Result, encoding_of, timed, timed_codes
from megatron_zb.schedule.generators.torch_style import dualpipev_orders
from megatron_zb.schedule.generators.v_auto import dualpipev_peak
from megatron_zb.schedule.generators.v_blocks import all_blocks, as_passes, plain_peak
from megatron_zb.schedule.generators.v_family import block_codes
from megatron_zb.schedule.generators.v_reorder import reordered_variants
from megatron_zb.schedule.generators.v_squeeze import squeezed_codes
from megatron_zb.schedule.ir import Schedule, ScheduleError, parse_orders
from megatron_zb.schedule.placement import linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names
from megatron_zb.schedule.simulate import memory_levels, simulate
from megatron_zb.schedule.validate import validate

PROFILES = {  # (T_F, T_B, T_W, T_comm) per stage; memory F +1, B -0.55, W -0.45 (docs/bench_schedules.md)
    "A": (18522, 18086, 9337, 601),
    "B": (29718, 29444, 19927, 527),
    "C": (11347, 11248, 8132, 377),
    "E": (18522, 18086, 9337, 601),  # first and last stage 1.5x (HEAVY_ENDS)
    "F": (18522, 18086, 9337, 3704),  # comm 20% of T_F
    "G": (18522, 18086, 3617, 3704),  # both, light W
}
HEAVY_ENDS = {"E", "G"}


def profile(p: int, name: str) -> CostModel:
    t_f, t_b, t_w, comm = PROFILES[name]
    scale = [1.5 if name in HEAVY_ENDS and s in (0, p - 1) else 1.0 for s in range(p)]
    t_f, t_b, t_w = ([t * x for x in scale] for t in (t_f, t_b, t_w))
    return CostModel(p, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=comm, mem_f=1, mem_b=-0.55, mem_w=-0.45)


def reordered_orders(p: int, m: int, block, fill: bool):
    """The block reordered (with its gaps filled or not) as orders of passes; None where it is given up."""
    codes = reordered_variants(p, m, list(block), (fill,))[0]
    return None if codes is None else [list(map(encoding_of((v_shape(p),), m).decode, row)) for row in codes]


def uneven_memory(p: int) -> CostModel:
    return CostModel(
        p,
        mem_f=[1.0 + 0.1 * s for s in range(p)],
        mem_b=[-0.6 - 0.05 * s for s in range(p)],
        mem_w=[-0.4 - 0.05 * s for s in range(p)],
    )


def gpt_like(p: int) -> CostModel:
    return CostModel(p, t_f=[1.2 if s in (0, p - 1) else 1.0 for s in range(p)], t_b=1.1, t_w=0.7, t_comm=0.05)


def sampled_blocks(p: int, count: int = 10) -> list:
    blocks = list(all_blocks(p))
    return blocks[:: max(1, len(blocks) // count)]


def as_schedule(orders, p: int, m: int) -> Schedule:
    return Schedule("candidate", (v_shape(p),), m, tuple(map(tuple, orders)))


# The reference implementation's adaptive V scheduler (sail-sg/zero-bubble-pipeline-parallelism,
# zerobubble/scheduler/v_auto_schedule.py, run from a fetched copy outside this repository with
# max_mem = 2 L chunk activations and half-stage costs, its orders converted to ours and timed by
# our simulator at the same peak): stage-span bubble at (pp, m, profile, --memory-limit L).
REFERENCE_V_AUTO = {
    (4, 12, "C", 2.0): 0.240752,
    (4, 12, "C", 3.5): 0.079156,
    (8, 24, "A", 4.0): 0.299251,
    (8, 24, "A", 5.0): 0.169541,
    (8, 24, "A", 6.0): 0.139775,
    (8, 24, "A", 7.0): 0.105603,
    (8, 24, "A", 7.5): 0.091798,
    (8, 24, "B", 4.5): 0.231429,
    (8, 24, "B", 6.0): 0.113247,
    (16, 48, "A", 8.0): 0.300556,
    (16, 48, "A", 10.0): 0.182159,
    # the same way, the reference given the stages' mean costs (it takes one number per pass kind)
    (8, 27, "E", 6.0): 0.292844,
    (8, 24, "F", 4.0): 0.428604,
    (8, 32, "G", 8.0): 0.291689,
}


@pytest.mark.parametrize("p,m,name,limit", sorted(REFERENCE_V_AUTO))
def test_v_auto_is_never_worse_than_the_reference_adaptive_scheduler(p, m, name, limit):
    costs = profile(p, name)
    schedule = build("v-auto", ScheduleSpec(p, m, costs=costs, memory_limit=limit))
    timeline = simulate(schedule, costs)
    assert max(timeline.peak_memory) <= limit + 1e-9
    assert timeline.bubble_rate <= REFERENCE_V_AUTO[p, m, name, limit] + 1e-6


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_reordered_blocks_are_valid_orders(p):
    costs = gpt_like(p)
    for m in (1, p, 2 * p + 1):
        for block in sampled_blocks(p):
            for fill in (False, True):
                orders = reordered_orders(p, m, block, fill)
                if orders is not None:
                    assert validate(as_schedule(orders, p, m), costs) == []


@pytest.mark.parametrize("p", [3, 4, 6])
def test_a_stretched_steady_state_is_as_short_as_planning_all_microbatches(p):
    # from 3pp microbatches (fewer_microbatches' least): with 2pp a squeezed block's warm-up and
    # cool-down still touch, and stretching it can come out a few % longer
    costs, fewer, more = profile(p, "A"), 3 * p, 3 * p + 1
    stretched = planned = 0
    for block in sampled_blocks(p):
        plans = [lambda n, b=block: reordered_orders(p, n, b, False)]
        plans.append(lambda n, b=block: as_passes(p, n, squeezed_codes(p, n, lambda _, r: b[r])))
        for plan in plans:
            small, full = plan(fewer), plan(fewer + more)
            if small is None or full is None:
                continue
            planned += 1
            codes = extended(timed(small, v_shape(p), costs, fewer).codes, fewer, 6, more)
            if codes is not None:
                stretched += 1
                longer = timed_codes(codes, v_shape(p), costs, fewer + more)
                assert validate(as_schedule(longer.orders, p, fewer + more), costs) == []
                assert longer.stage_span == pytest.approx(timed(full, v_shape(p), costs, fewer + more).stage_span)
    assert planned > 0 and stretched >= 0.9 * planned  # a tiny pp may lack a steady period at 3pp


def test_an_order_without_a_steady_state_is_not_stretched():
    orders = parse_orders("rank 0: F s0 mb0, F s0 mb1, B s0 mb1, W s0 mb1, B s0 mb0, W s0 mb0")
    result = timed(orders, linear(1), CostModel(1), 2)
    assert extended(result.codes, 2, 3, 5) is None


def test_polish_moves_a_weight_gradient_off_the_critical_path():
    # Unit costs, pp=2: rank 1 runs W s1 mb0 before F s1 mb1, so B s1 mb1 and rank 0's last B and W
    # come one unit late (stage span 8). Running that W last gives rank 0 a span of 7.
    orders = parse_orders(
        "rank 0: F s0 mb0, F s0 mb1, B s0 mb0, W s0 mb0, B s0 mb1, W s0 mb1\n"
        "rank 1: F s1 mb0, B s1 mb0, W s1 mb0, F s1 mb1, B s1 mb1, W s1 mb1"
    )
    costs = CostModel(2)
    result = timed(orders, linear(2), costs, 2)
    assert result.stage_span == 8
    better = polish(result, linear(2), costs, 2.0)
    assert better.stage_span == 7
    schedule = Schedule("polished", (linear(2),), 2, tuple(map(tuple, better.orders)))
    assert validate(schedule, costs, 2.0) == []
    assert simulate(schedule, costs).stage_span == 7
    # under rank 1's own peak (1) the W cannot wait: nothing to gain
    assert polish(result, linear(2), costs, 1.0) is result


@pytest.mark.parametrize("p", [3, 5])
def test_polish_is_never_worse_and_keeps_the_limit(p):
    costs, m = gpt_like(p), 2 * p + 1
    for block in sampled_blocks(p, 6):
        result = timed_codes(squeezed_codes(p, m, lambda _, r, b=block: b[r]), v_shape(p), costs, m)
        better = polish(result, v_shape(p), costs, result.peak)
        assert better.score()[:2] <= result.score()[:2]
        assert better.peak <= result.peak + 1e-9
        schedule = as_schedule(better.orders, p, m)
        assert validate(schedule, costs, result.peak) == []
        assert simulate(schedule, costs).stage_span == pytest.approx(better.stage_span)


@pytest.mark.parametrize("p", [2, 4, 7])
def test_the_closed_form_peak_is_the_peak_of_the_repeated_block(p):
    for costs in (profile(p, "A"), uneven_memory(p)):
        for block in sampled_blocks(p):
            schedule = as_schedule(
                as_passes(p, 3 * p, block_codes(p, 3 * p, lambda _, r, b=block: list(b[r]))), p, 3 * p
            )
            simulated = max(max(levels) for levels in memory_levels(schedule, costs))
            assert plain_peak(block, costs) == pytest.approx(simulated)


def test_integer_timing_is_the_simulators():
    for name in names():
        if get(name).composite:
            continue
        for p, m in ((2, 3), (4, 8)):
            costs = CostModel(p, t_f=[1.0 + 0.1 * s for s in range(p)], t_b=1.3, t_w=0.7, t_comm=0.05)
            try:
                schedule = build(name, ScheduleSpec(p, m, costs=costs))
            except ScheduleError:
                continue
            timeline = simulate(schedule, costs)
            result = timed(schedule.orders, schedule.placements, costs, m)
            assert (result.stage_span, result.makespan) == pytest.approx((timeline.stage_span, timeline.makespan))
            assert result.peak == pytest.approx(max(timeline.peak_memory))
            assert timed_codes(result.codes, schedule.placements, costs, m) == Result(
                result.codes, result.encoding, result.stage_span, result.makespan, result.peak
            )


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_the_dualpipev_peak_v_auto_checks_on_2pp_microbatches_holds_for_any_number(p):
    for costs in (profile(p, "A"), uneven_memory(p)):
        for m in (2 * p + 1, 3 * p, 5 * p + 2):
            orders = dualpipev_orders(p, m)
            simulated = max(max(levels) for levels in memory_levels(as_schedule(orders, p, m), costs))
            assert dualpipev_peak(p, costs) == pytest.approx(simulated)
