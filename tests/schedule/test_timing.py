"""The planners' timing model (timing.py): read from the IR, the simulator's times, what each pass waited for."""

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.moves import SPLIT, defer, fill_idle, split_backward
from megatron_zb.schedule.generators.result import timed, timed_schedule
from megatron_zb.schedule.ir import BW, B, F, PassKind, Schedule, W, parse_orders
from megatron_zb.schedule.placement import interleaved, linear
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.timing import COMPUTE, DEFERRABLE, ROLES, Clock, Encoding, Model, run


def test_kinds_and_roles_come_from_the_ir():
    assert COMPUTE == (PassKind.F, PassKind.B, PassKind.W, PassKind.BW)
    assert ROLES == ("F", "B", "W")
    assert DEFERRABLE == {PassKind.W}  # nothing waits for a W
    assert SPLIT == {PassKind.BW: (PassKind.B, PassKind.W)}


def test_codes_round_trip_over_two_pipes():
    schedule = build("bitpipe", ScheduleSpec(4, 8))
    encoding = Encoding(schedule.placements, 8)
    passes = [p for order in schedule.orders for p in order]
    codes = [encoding.encode(p) for p in passes]
    assert len(set(codes)) == len(codes) and all(0 <= c < encoding.size for c in codes)
    assert [encoding.decode(c) for c in codes] == passes


def test_the_clock_records_what_each_pass_waited_for():
    # pp=2, unit costs, 1F1B split: rank 0 waits for B s1 mb0 (ends at 3) before B s0 mb0, and idles 3 to 6
    orders = parse_orders(
        "rank 0: F s0 mb0, F s0 mb1, B s0 mb0, W s0 mb0, B s0 mb1, W s0 mb1\n"
        "rank 1: F s1 mb0, B s1 mb0, W s1 mb0, F s1 mb1, B s1 mb1, W s1 mb1"
    )
    encoding = Encoding((linear(2),), 2)
    model = Model(encoding, CostModel(2))
    clock = run(model, [[encoding.encode(p) for p in order] for order in orders])
    start = {encoding.decode(code): clock.start[code] for code in range(encoding.size) if clock.start[code]}
    assert (start[B(0, 0)], start[F(1, 1)], start[B(1, 1)], start[B(0, 1)]) == (3, 4, 5, 6)
    waited = clock.cause[encoding.encode(B(0, 0))]
    assert waited == model.writes[encoding.encode(B(1, 0)) // 2][0]  # the role B s1 mb0
    assert clock.cause[encoding.encode(W(0, 0))] == -1  # its B ran just before on the same rank
    assert clock.spans() == (8.0, 8.0) and clock.peak == [2.0, 1.0]


def test_a_pass_before_its_input_on_its_own_rank_does_not_run():
    encoding = Encoding((linear(1),), 1)
    clock = Clock(Model(encoding, CostModel(1)))
    assert not clock.place(encoding.encode(B(0, 0)))
    assert clock.ready(encoding.encode(B(0, 0))) is None
    assert clock.place(encoding.encode(F(0, 0))) and clock.ready(encoding.encode(B(0, 0))) == 1.0
    assert run(Model(encoding, None), [[encoding.encode(W(0, 0)), encoding.encode(BW(0, 0))]]) is None


def test_a_seed_over_the_memory_limit_is_passed_over_before_timing():
    schedule = build("1f1b", ScheduleSpec(2, 4))  # rank 0 holds 2 microbatches, rank 1 one
    costs = CostModel(2)
    assert timed_schedule(schedule, costs, limit=1.5) is None
    kept = timed_schedule(schedule, costs, limit=2.0)
    assert kept.peak == 2.0 and kept.score() == timed_schedule(schedule, costs).score()
    assert kept.label == "1f1b"


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_filling_idle_time_with_ws_is_never_slower(chunks):
    costs = CostModel(4, t_f=[1.2, 1, 1, 1.2], t_b=1.1, t_w=0.7, t_comm=0.05)
    plain = build("breadth-first", ScheduleSpec(4, 8, chunks, costs))
    at_once = Schedule("x", plain.placements, 8, split_backward(plain.orders))
    seed = timed_schedule(at_once, costs)
    filled = fill_idle(seed, costs)
    assert filled.score()[:2] <= seed.score()[:2] <= timed_schedule(plain, costs).score()[:2]
    deferred = timed(defer(at_once.orders), interleaved(4, chunks) if chunks > 1 else linear(4), costs, 8)
    assert (
        deferred.score()[:2]
        == timed_schedule(Schedule("d", plain.placements, 8, defer(at_once.orders)), costs).score()[:2]
    )
    assert simulate(
        Schedule("f", plain.placements, 8, tuple(map(tuple, filled.orders))), costs
    ).stage_span == pytest.approx(filled.stage_span)
