"""zb-v is no worse than the reference planner's ZB-V where that used to win (scripts/bench_vs_reference.py).

The settings come from that script's campaign (seed 4040): the reference's zbv.py, given the median stage
costs, had the shorter stage span on the first three until zb-v took the ZB-V rounds planned at the median
costs as a seed (v_family.flat_round_result), and the shorter makespan on the last three (#30, #35, #48)
until zb-v's pick had to dominate that seed and got its trailing Ws moved into idle gaps (v_tail.py). Its
stage span and makespan bubbles were measured once by the script (its orders converted and timed by our
simulator on the true costs) and are written down here.
"""

from __future__ import annotations

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.v_family import flat_round_result
from megatron_zb.schedule.generators.zbv_rounds import flat
from megatron_zb.schedule.ir import Schedule
from megatron_zb.schedule.placement import v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate

# (pp, m, per-stage T_F, T_B/T_F, T_W/T_B, T_comm) -> the reference's (stage-span bubble, makespan bubble)
CASES = {
    "pp 8, m 29": (
        (8, 29, (1.7367, 0.9989, 0.9828, 1.1349, 0.8917, 1.1931, 0.8436, 1.5568), 1.4755, 0.3341, 0.2015),
        (0.307237, 0.307237),
    ),
    "pp 13, m 16": (
        (
            13,
            16,
            (1.4406, 0.8032, 0.873, 0.8997, 0.8667, 1.0336, 1.027, 1.0077, 0.9413, 1.1931, 1.0991, 0.9068, 1.1387),
            1.9309,
            0.458,
            0.0594,
        ),
        (0.283436, 0.283436),
    ),
    "pp 14, m 26": (
        (
            14,
            26,
            (
                1.2906,
                1.1821,
                0.8915,
                0.935,
                0.801,
                0.8093,
                0.9299,
                1.1304,
                0.9855,
                1.0629,
                1.1583,
                0.8867,
                0.941,
                1.1018,
            ),
            1.4526,
            0.8161,
            0.1847,
        ),
        (0.180094, 0.210603),
    ),
    "pp 11, m 59": (
        (
            11,
            59,
            (1.5945, 1.1952, 0.8394, 0.993, 1.0197, 0.8372, 1.0185, 1.0821, 0.9418, 1.1128, 1.0813),
            1.2613,
            0.8156,
            0.1493,
        ),
        (0.209032, 0.209032),
    ),
    "pp 16, m 101": (
        (
            16,
            101,
            (
                1.2946,
                1.0597,
                0.9503,
                1.1483,
                0.9159,
                1.0724,
                0.8552,
                0.96,
                0.9475,
                1.1692,
                1.1631,
                0.8042,
                0.8563,
                1.1907,
                1.1865,
                1.2354,
            ),
            2.0646,
            0.6097,
            0.1548,
        ),
        (0.178957, 0.178957),
    ),
    "pp 4, m 14": ((4, 14, (1.3436, 1.1797, 1.1601, 1.6475), 1.206, 0.9719, 0.2482), (0.139395, 0.148010)),
}
# Before the seed, ours was 30.86 %, 28.93 % and 18.74 % (stage span) on the first three; before the
# dominance rule and the sunk Ws, 20.98 %, 18.04 % and 14.80 % (makespan; 14.8017 % on pp 4) on the last three.


def costs_of(p: int, t_f: tuple[float, ...], b_ratio: float, w_ratio: float, comm: float) -> CostModel:
    t_b = [b_ratio * x for x in t_f]
    return CostModel(
        p, t_f=t_f, t_b=t_b, t_w=[w_ratio * x for x in t_b], t_comm=comm, mem_f=1, mem_b=-0.55, mem_w=-0.45
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_zb_v_not_worse_than_reference(case):
    (p, m, t_f, b_ratio, w_ratio, comm), (span, makespan) = CASES[case]
    costs = costs_of(p, t_f, b_ratio, w_ratio, comm)
    timeline = simulate(build("zb-v", ScheduleSpec(p, m, costs=costs)), costs)
    assert timeline.bubble_rate <= span + 1e-6
    assert timeline.bubble_rate_makespan <= makespan + 1e-6
    assert max(timeline.peak_memory) <= p + 1e-9  # 1f1b's memory, as the reference's ZB-V


def test_the_median_seed_reaches_the_reference():
    """The seed alone reaches the reference's numbers (it plans as zbv.py does, with one cost per pass kind;
    here 27.93 %, below the reference's 28.34 %: the reruns and the choice among switches differ a little)."""
    (p, m, t_f, b_ratio, w_ratio, comm), (span, makespan) = CASES["pp 13, m 16"]
    costs = costs_of(p, t_f, b_ratio, w_ratio, comm)
    seed = flat_round_result(costs, float(p), m)
    assert seed is not None
    timeline = simulate(Schedule("seed", (v_shape(p),), m, tuple(map(tuple, seed.orders))), costs)
    assert timeline.bubble_rate == pytest.approx(0.279250029, abs=1e-9) and 0.279250029 < span
    assert timeline.bubble_rate_makespan < makespan


def test_flat_takes_the_median_of_each_time():
    costs = CostModel(
        4,
        t_f=[1.0, 3.0, 2.0, 10.0],
        t_b=[2.0, 2.0, 4.0, 4.0],
        t_w=1.0,
        t_comm=0.5,
        mem_f=[1, 2, 3, 4],
        mem_b=-0.5,
        mem_w=[-0.5, -1.5, -2.5, -3.5],
    )
    planned = flat(costs)
    assert (planned.t_f, planned.t_b, planned.t_w) == ((2.5,) * 4, (3.0,) * 4, (1.0,) * 4)
    assert (planned.t_comm, planned.mem_f, planned.mem_b) == (costs.t_comm, costs.mem_f, costs.mem_b)


def test_no_median_seed_on_equal_stages_or_large_settings():
    assert flat_round_result(CostModel(4, t_f=1.0, t_b=2.0, t_w=1.0), 4.0, 8) is None
    uneven = CostModel(32, t_f=[1.4] + [1.0] * 30 + [1.6])
    assert flat_round_result(uneven, 32.0, 256) is None  # planned on a sample there (search.eval_microbatches)
    assert flat_round_result(uneven, 32.0, 32) is not None
