"""1F1B with unequal per-stage costs and comm latency against independent computations."""

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate


def test_1f1b_two_stages_by_hand():
    costs = CostModel(2, t_f=(1, 2), t_b=(2, 3), t_w=(1, 1), t_comm=0.5)
    t = simulate(build("1f1b", ScheduleSpec(2, 2, costs=costs)), costs)
    # rank 0 order: F0 F1 BW0 BW1; rank 1: F0 BW0 F1 BW1. BW costs (3, 4).
    # r0 F0 [0,1]  F1 [1,2]
    # r1 F0 [1.5,3.5]  BW0 [3.5,7.5]  F1 max(7.5, 2+0.5) -> [7.5,9.5]  BW1 [9.5,13.5]
    # r0 BW0 max(2, 7.5+0.5) -> [8,11]  BW1 max(11, 13.5+0.5) -> [14,17]
    spans = [[(x.start, x.end) for x in rank] for rank in t.ranks]
    assert spans == [[(0, 1), (1, 2), (8, 11), (14, 17)], [(1.5, 3.5), (3.5, 7.5), (7.5, 9.5), (9.5, 13.5)]]
    assert t.makespan == 17
    assert t.stage_span == 17  # rank 0: 0..17; rank 1: 1.5..13.5
    work = (1 + 3) * 2 + (2 + 4) * 2
    assert t.bubble_rate == pytest.approx((2 * 17 - work) / (2 * 17))


def one_f_one_b_recurrence(t_f, t_bw, c, m):
    """Start times from the 1F1B recurrence, written without the simulator or the IR.

    Rank s runs w = min(p-1-s, m) forwards, then (F, BW) pairs, then w BWs. A pass starts
    when its rank is free and its input has arrived (c later when it crosses ranks).
    """
    p = len(t_f)
    f_end = [[None] * m for _ in range(p)]
    bw_end = [[None] * m for _ in range(p)]
    kinds = []
    for s in range(p):
        w = min(p - 1 - s, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i), ("BW", i)]
        order += [("BW", i) for i in range(m - w, m)]
        kinds.append(order)
    pos, free = [0] * p, [0.0] * p
    while any(pos[s] < len(kinds[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(kinds[s]):
                kind, i = kinds[s][pos[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else f_end[s - 1][i]
                    dep_lat = 0 if s == 0 else c
                else:
                    ready = f_end[s][i] if s == p - 1 else bw_end[s + 1][i]
                    dep_lat = 0 if s == p - 1 else c
                if ready is None:
                    break
                start = max(free[s], ready + dep_lat)
                end = start + (t_f[s] if kind == "F" else t_bw[s])
                (f_end if kind == "F" else bw_end)[s][i] = end
                free[s] = end
                pos[s] += 1
    return max(max(row) for row in bw_end)


@pytest.mark.parametrize("p,m", [(3, 2), (3, 4), (4, 6)])
def test_1f1b_matches_recurrence(p, m):
    t_f = [1.2, 0.9, 1.0, 1.5][:p]
    t_b = [1.1, 1.4, 0.8, 1.3][:p]
    t_w = [0.6, 0.7, 0.5, 0.9][:p]
    costs = CostModel(p, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=0.05)
    t = simulate(build("1f1b", ScheduleSpec(p, m, costs=costs)), costs)
    expected = one_f_one_b_recurrence(t_f, [b + w for b, w in zip(t_b, t_w, strict=True)], 0.05, m)
    assert t.makespan == pytest.approx(expected)
