"""BitPipe: the reference order's closed-form bubble, replica syncs planned per pair, never-worse bitpipe-zb."""

from __future__ import annotations

import pytest

from megatron_zb.schedule import CostModel, ScheduleSpec, build, simulate, validate
from megatron_zb.schedule.execute import DeadlockError, execute
from megatron_zb.schedule.ir import Pass, PassKind, ScheduleError
from megatron_zb.schedule.lower import DataParallel, lower


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_reference_order_bubble_matches_the_closed_form(p, loops):
    """Unit costs per stage, chunks of half a stage: f = 0.5, b = 1 (fused B+W). Bubble time per rank
    (p-2)*b + (m/p - 1)(p-2)(b - f): a partial drain and refill between the loops of pp microbatches."""
    m = p * loops
    timeline = simulate(build("bitpipe", ScheduleSpec(p, m)))
    f, b = 0.5, 1.0
    assert timeline.makespan - 3 * m == pytest.approx((p - 2) * b + (m / p - 1) * (p - 2) * (b - f))
    assert max(timeline.peak_memory) == pytest.approx(p)  # 1F1B's memory


def test_reference_order_of_rank_zero_at_pp4():
    """The reference's executed order (decoded from its index tables): A runs mb0, mb1, B mb2, mb3."""
    order = build("bitpipe", ScheduleSpec(4, 4)).orders[0]
    assert [str(q) for q in order] == [
        "F s0 mb0", "F s0 mb1", "F s3 mb2 d1", "F s4 mb2 d1", "F s3 mb3 d1", "F s4 mb3 d1", "F s7 mb0",
        "BW s7 mb0", "F s7 mb1", "BW s7 mb1", "BW s4 mb2 d1", "BW s3 mb2 d1", "BW s4 mb3 d1", "BW s3 mb3 d1",
        "BW s0 mb0", "BW s0 mb1",
    ]  # fmt: skip


def test_directions_take_disjoint_halves_of_the_batch():
    schedule = build("bitpipe", ScheduleSpec(4, 8))
    pipe_of = {q.microbatch: q.pipe for order in schedule.orders for q in order}
    assert sorted(mb for mb, pipe in pipe_of.items() if pipe == 0) == [0, 1, 2, 3]
    assert sorted(mb for mb, pipe in pipe_of.items() if pipe == 1) == [4, 5, 6, 7]
    assert schedule.shared == tuple(((0, s), (1, s)) for s in range(8))


def test_lowering_syncs_every_pair_once_in_one_order_on_both_ranks():
    costs = CostModel(4, t_dp=0.5)
    lowered = lower(build("bitpipe", ScheduleSpec(4, 4)), DataParallel(), costs)
    assert validate(lowered) == []
    syncs = [[q for q in order if q.kind is PassKind.REPLICA_SYNC] for order in lowered.orders]
    for j in range(2):
        partner = 3 - j
        mine = [lowered.replica(q.pipe, q.stage) for q in syncs[j]]
        theirs = [(q.pipe, q.stage) for q in syncs[partner]]
        assert mine == theirs, "the pair's syncs come in the same order on both ranks"
        assert len(mine) == 4  # four chunks, each with its copy on the partner
    # the second-half blocks are synced first (their backward ends first), each before the REDUCE_GRAD
    assert [str(q) for q in lowered.orders[0] if not q.kind.is_compute] == [
        "REPLICA_SYNC s7", "REDUCE_GRAD s7", "REPLICA_SYNC s4 d1", "REDUCE_GRAD s4 d1",
        "REPLICA_SYNC s3 d1", "REDUCE_GRAD s3 d1", "REPLICA_SYNC s0", "REDUCE_GRAD s0",
    ]  # fmt: skip
    # the first sync of rank 0 (second-half block s7) runs before its last backward
    order = lowered.orders[0]
    last_backward = max(i for i, q in enumerate(order) if q.kind is PassKind.BW)
    assert order.index(Pass(PassKind.REPLICA_SYNC, 7, 0)) < last_backward


def test_mismatched_pair_order_is_a_named_deadlock():
    lowered = lower(build("bitpipe", ScheduleSpec(4, 4)), DataParallel(reduce_grad=False))
    orders = [list(order) for order in lowered.orders]
    syncs = [q for q in orders[3] if q.kind is PassKind.REPLICA_SYNC]  # rank 3 syncs last, in the other order
    orders[3] = [q for q in orders[3] if q.kind is not PassKind.REPLICA_SYNC] + syncs[::-1]
    broken = lowered.__class__(lowered.name, lowered.placements, 4, tuple(map(tuple, orders)), lowered.shared)
    with pytest.raises(DeadlockError, match=r"deadlock: collective #0 on ranks \[0, 3\] does not match"):
        execute(broken, lambda q: 1.0)
    assert [issue.rule for issue in validate(broken)] == ["deadlock"]


def test_settings_it_cannot_run_are_refused_with_what_works():
    with pytest.raises(ScheduleError, match="needs microbatches divisible by pp=4 .* got 6; use 4 or 8"):
        build("bitpipe", ScheduleSpec(4, 6))
    with pytest.raises(ScheduleError, match="needs an even pipeline size of at least 2"):
        build("bitpipe", ScheduleSpec(3, 6))
    with pytest.raises(ScheduleError, match="runs four chunks per rank"):
        build("bitpipe-zb", ScheduleSpec(4, 4, 2))


GPT = {"t_f": [1.2, 1, 1, 1.2], "t_b": 1.1, "t_w": 0.7, "t_comm": 0.05}


@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("gpt", [False, True])
def test_bitpipe_zb_is_never_worse_at_bitpipes_peak(m, gpt):
    costs = CostModel(4, **GPT) if gpt else CostModel(4)
    plain = simulate(build("bitpipe", ScheduleSpec(4, m, costs=costs)), costs)
    peak = max(plain.peak_memory)
    split = simulate(build("bitpipe-zb", ScheduleSpec(4, m, costs=costs, memory_limit=peak)), costs)
    assert max(split.peak_memory) <= peak + 1e-9
    assert split.stage_span <= plain.stage_span + 1e-9
    assert split.bubble_rate < plain.bubble_rate  # it does fill the drains
