"""Closed forms of the schedules with unit costs and no comm latency (schedules note)."""

import pytest

from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 3 * p, 8 * p)]


def timeline(name, p, m, chunks=None):
    return simulate(build(name, ScheduleSpec(p, m, chunks)))


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b_makespan_and_memory(p, m):
    t = timeline("1f1b", p, m)
    assert t.makespan == 3 * (m + p - 1)
    assert t.bubble_rate_makespan == pytest.approx((p - 1) / (m + p - 1))
    assert t.peak_memory[0] == p
    assert t.peak_memory == tuple(float(p - r) for r in range(p))


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_makespan_with_1f1b_memory(p, m):
    t = timeline("zb-h1", p, m)
    assert t.makespan == 3 * m + p - 1
    assert t.bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))
    assert max(t.peak_memory) == max(timeline("1f1b", p, m).peak_memory) == t.peak_memory[0] == p


@pytest.mark.parametrize("p,m", GRID)
def test_zb_h2_zero_bubble_where_possible(p, m):
    t = timeline("zb-h2", p, m)
    assert max(t.peak_memory) <= 2 * p - 1
    assert t.peak_memory[0] == min(m, 2 * p - 1)
    # Rank 0 cannot finish before F and B of the last microbatch crossed all ranks and its W
    # ran: 2m + 2p - 1 units. Below m = 2p-1 that exceeds the work 3m, so zero bubble needs
    # m >= 2p-1; ZB-H2 reaches this bound everywhere.
    assert t.stage_span == max(3 * m, 2 * m + 2 * p - 1)
    assert t.makespan == max(3 * m + p - 1, 2 * m + 2 * p - 1)
    if m >= 2 * p - 1:
        assert t.bubble_rate == 0
    else:
        assert t.bubble_rate == pytest.approx(1 - 3 * m / (2 * m + 2 * p - 1))


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_1f1b_makespan(p, m, v):
    t = timeline("interleaved-1f1b", p, m, v)
    assert t.makespan == pytest.approx(3 * m + 3 * (p - 1) / v, abs=1e-9)
    ideal = 3 * m
    assert (t.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert t.schedule.chunks == v


@pytest.mark.parametrize("p,m", [(4, 1), (4, 3), (8, 5), (16, 2)])
def test_fewer_microbatches_than_ranks(p, m):
    assert timeline("1f1b", p, m).makespan == 3 * (m + p - 1)
    # ZB: (m+p-1)(T_F+T_B) + T_W: the Ws wait for no one.
    assert timeline("zb-h1", p, m).makespan == 2 * (m + p - 1) + 1
    assert timeline("zb-h2", p, m).makespan == 2 * (m + p - 1) + 1


def test_interleaved_chunk_memory_counts_a_fraction_of_a_stage():
    t = timeline("interleaved-1f1b", 4, 8, 2)
    # rank 3 warms up with (v-1)*p = 4 chunk forwards, then one more before its first BW:
    # 5 half-stage activations.
    assert t.peak_memory[3] == 2.5
    assert t.peak_memory[0] == (2 * 3 + 4 + 1) / 2
