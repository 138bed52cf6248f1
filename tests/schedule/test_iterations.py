"""Iterations back to back: ready times in execute, microbatch offsets, and what post-validation buys."""

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.execute import Span, execute
from megatron_zb.schedule.ir import PassKind, ScheduleError
from megatron_zb.schedule.iterations import repeat, simulate_iterations
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import validate


def schedule(name, p, m, costs=None):
    return build(name, ScheduleSpec(p, m, costs=costs or CostModel(p)))


def unit(_):
    return 1.0


def test_execute_ready_delays_each_rank_from_its_own_time():
    s = schedule("1f1b", 2, 1)  # rank 0: F s0, BW s0; rank 1: F s1, BW s1 (BW costs 2)

    def spans(ready):
        timed = execute(s, lambda p: 2.0 if p.kind is PassKind.BW else 1.0, 0.0, ready)
        return [[(x.start, x.end) for x in rank] for rank in timed]

    assert spans(None) == [[(0, 1), (4, 6)], [(1, 2), (2, 4)]]
    assert spans((0, 0)) == spans(None)
    assert spans((3, 0)) == [[(3, 4), (7, 9)], [(4, 5), (5, 7)]]  # rank 1 waits for F s0 anyway
    assert spans((0, 5)) == [[(0, 1), (8, 10)], [(5, 6), (6, 8)]]


def test_execute_ready_keeps_the_default_and_checks_its_length():
    s = schedule("zb-h2", 4, 8)
    assert execute(s, unit, 0.5, (0.0,) * 4) == execute(s, unit, 0.5)
    assert execute(s, unit)[0][0] == Span(0.0, 1.0)
    with pytest.raises(ValueError, match="3 times for 4 ranks"):
        execute(s, unit, 0.0, (0.0, 0.0, 0.0))


def test_repeat_offsets_microbatches_and_stays_valid():
    s = schedule("zb-h1", 2, 2)
    combined = repeat(s, 3)
    assert combined.microbatches == 6 and combined.placements == s.placements
    for order, original in zip(combined.orders, s.orders, strict=True):
        n = len(original)
        assert len(order) == 3 * n
        for k in range(3):
            assert [p.microbatch for p in order[k * n : (k + 1) * n]] == [p.microbatch + 2 * k for p in original]
            assert [(p.kind, p.stage) for p in order[k * n : (k + 1) * n]] == [(p.kind, p.stage) for p in original]
    assert validate(combined) == []


def test_synchronous_iterations_are_the_single_one_shifted_by_the_makespan():
    s = schedule("zb-h1", 4, 8)
    single = simulate(s)
    run = simulate_iterations(s, iterations=3)
    assert single.makespan == 27
    assert run.starts == ((0.0,) * 4, (27.0,) * 4, (54.0,) * 4)
    assert run.timeline.schedule.name == "zb-h1 x3 (synchronous step)"
    for rank, passes in enumerate(run.timeline.ranks):
        n = len(single.ranks[rank])
        assert [p.pass_ for p in passes] == list(run.timeline.schedule.orders[rank])
        for k in range(3):
            assert [(t.start, t.end) for t in passes[k * n : (k + 1) * n]] == [
                (t.start + 27 * k, t.end + 27 * k) for t in single.ranks[rank]
            ]
    assert run.timeline.peak_memory == single.peak_memory
    assert run.timeline.makespan == 81


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (4, 12), (8, 8)])
def test_1f1b_period_is_the_makespan_either_way(p, m):
    """Rank 0 starts first and ends last, so stepping early on other ranks gains nothing."""
    s = schedule("1f1b", p, m)
    assert simulate(s).makespan == 3 * (m + p - 1)
    for post_validation in (False, True):
        assert simulate_iterations(s, iterations=3, post_validation=post_validation).period == 3 * (m + p - 1)


@pytest.mark.parametrize(
    "name,p,m",
    [
        ("zb-2p", 2, 6),
        ("zb-2p", 3, 9),
        ("zb-2p", 4, 12),
        ("zb-2p", 4, 16),
        ("zb-2p", 8, 24),
        ("zb-h2", 2, 3),
        ("zb-h2", 3, 5),
        ("zb-h2", 4, 7),
        ("zb-h2", 4, 8),
        ("zb-h2", 8, 15),
    ],
)
def test_zero_bubble_with_post_validation_only(name, p, m):
    """zb-2p (m >= 3p) and zb-h2 (m >= 2p-1): the stage span 3m per iteration, the makespan without."""
    s = schedule(name, p, m)
    single = simulate(s)
    assert (single.stage_span, single.makespan) == (3 * m, 3 * m + p - 1)
    for iterations in (2, 3, 5):
        assert simulate_iterations(s, iterations=iterations, post_validation=True).period == 3 * m
        assert simulate_iterations(s, iterations=iterations).period == 3 * m + p - 1


def test_comm_latency_and_step_time():
    costs = CostModel(4, t_comm=0.5)
    s = schedule("zb-2p", 4, 12, costs)
    single = simulate(s, costs)
    assert (single.makespan, single.stage_span) == (40.5, 38)
    synchronous = simulate_iterations(s, costs, 3)
    post_validation = simulate_iterations(s, costs, 3, post_validation=True)
    assert synchronous.period == 41  # makespan + one all-reduce latency
    assert post_validation.period == 38  # the stage span
    assert synchronous.starts[1] == (41.0,) * 4
    # ends (38, 37.5, 39, 40.5); the partial statistics take 0.5 per hop from rank 0
    assert post_validation.ends[0] == (38, 37.5, 39, 40.5)
    assert post_validation.starts[1] == (38, 38.5, 39, 40.5)
    assert simulate_iterations(s, costs, 3, step_time=2).period == 43
    assert simulate_iterations(s, costs, 3, post_validation=True, step_time=2).period == 40


def test_post_validation_chain_on_1f1b_with_latency():
    """Rank 0 ends last, so rank r gets the partial r hops later; the activations arrive later still."""
    costs = CostModel(4, t_comm=0.5)
    run = simulate_iterations(schedule("1f1b", 4, 4, costs), costs, 3, post_validation=True)
    assert run.ends[0] == (26, 23.5, 21, 18.5)
    assert run.starts[1] == (26, 26.5, 27, 27.5)
    assert run.period == 26
    assert simulate_iterations(schedule("1f1b", 4, 4, costs), costs, 3).period == 26.5


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-2p", "zb-1p", "interleaved-1f1b", "zb-v", "v-half"])
@pytest.mark.parametrize("t_comm", [0.0, 0.7])
def test_post_validation_is_never_slower(name, t_comm):
    p, m = 4, 8
    costs = CostModel(p, t_f=(1.0, 1.5, 0.8, 1.2), t_b=(1.3, 2.0, 1.1, 0.9), t_w=(0.6, 1.4, 0.5, 1.0), t_comm=t_comm)
    s = schedule(name, p, m, costs)
    for iterations in (2, 3):
        synchronous = simulate_iterations(s, costs, iterations).period
        post_validation = simulate_iterations(s, costs, iterations, post_validation=True).period
        assert 0 < post_validation <= synchronous + 1e-9
        # the synchronous hand-over restarts every rank together, so its period is the makespan plus t_comm
        assert synchronous == pytest.approx(simulate(s, costs).makespan + t_comm)


def test_refusals():
    s = schedule("zb-h1", 2, 2)
    with pytest.raises(ScheduleError, match="at least 2"):
        simulate_iterations(s, iterations=1)
    with pytest.raises(ScheduleError, match="step_time"):
        simulate_iterations(s, step_time=-1)
    with pytest.raises(ValueError, match="pp=3"):
        simulate_iterations(s, CostModel(3))
