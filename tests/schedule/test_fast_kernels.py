"""The inlined timing loops give what the one-pass-at-a-time clock gives: ``timing.run`` against
``Clock.place``, and the list scheduler's own as-soon-as-possible clock against ``timing.spans``."""

from __future__ import annotations

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.greedy import ALL_SWITCHES, Stalled, _Greedy, min_memory_limit
from megatron_zb.schedule.generators.moves import split_backward
from megatron_zb.schedule.generators.result import encoding_of, model_of, timed_codes
from megatron_zb.schedule.ir import BW, B, F, W
from megatron_zb.schedule.placement import interleaved, linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.timing import Clock, run

FIELDS = ("end", "start", "cause", "free", "first", "idle", "most_idle", "level", "peak", "orders")


def uneven(p: int) -> CostModel:
    scale = [1.4 if s == 0 else 1.6 if s == p - 1 else 1.0 + 0.1 * s for s in range(p)]
    return CostModel(p, t_f=scale, t_b=[1.1 * x for x in scale], t_w=[0.6 * x for x in scale], t_comm=0.3)


def placed_one_by_one(model, orders) -> Clock | None:
    """``run`` as it was written before it was inlined: ``Clock.place`` per pass, sweeping both ways."""
    clock, at, moved, sweep = Clock(model), [0] * len(orders), True, list(range(len(orders)))
    while moved:
        moved = False
        for r in sweep:
            i = at[r]
            while i < len(orders[r]) and clock.place(orders[r][i]):
                i += 1
            moved, at[r] = moved or i > at[r], i
        sweep.reverse()
    return None if any(i < len(order) for i, order in zip(at, orders, strict=True)) else clock


@pytest.mark.parametrize("name, chunks", [("zb-v", None), ("zb-2p", 2), ("interleaved-1f1b", 3), ("v-half", None)])
def test_run_is_clock_place_pass_by_pass(name: str, chunks: int | None) -> None:
    p, m = 4, 9
    costs = uneven(p)
    schedule = build(name, ScheduleSpec(p, m, chunks, costs))
    model, encode = model_of(schedule.placements, m, costs), encoding_of(schedule.placements, m).encode
    codes = [[encode(x) for x in order] for order in schedule.orders]
    fast, slow = run(model, codes), placed_one_by_one(model, codes)
    assert slow is not None and slow.most_idle > 0
    assert all(getattr(fast, field) == getattr(slow, field) for field in FIELDS)
    codes[1][0], codes[1][-1] = codes[1][-1], codes[1][0]  # rank 1 starts with its last pass: a deadlock
    assert run(model, codes) is None and placed_one_by_one(model, codes) is None


@pytest.mark.parametrize("placement", [linear(4), interleaved(4, 2), interleaved(3, 4), v_shape(4)])
@pytest.mark.parametrize("strict", [False, True])
def test_list_scheduler_reports_its_orders_timed(placement, strict: bool) -> None:
    costs, m = uneven(placement.pp), 11
    for limit in (None, min_memory_limit(placement, costs) * 1.5, placement.pp * 1.0):
        for switches in ALL_SWITCHES[::3]:
            try:
                result = _Greedy(placement, costs, m, limit, switches, strict).run()
            except Stalled:
                assert not strict  # the room held in a strict run keeps the oldest microbatch moving
                continue
            timed = timed_codes(result.codes, placement, costs, m)
            assert (result.stage_span, result.makespan, result.peak) == (timed.stage_span, timed.makespan, timed.peak)
            assert sorted(code for order in result.codes for code in order) == list(range(3 * m * placement.num_stages))


def test_split_backward_splits_fused_passes_in_place() -> None:
    orders = ((F(0, 0), BW(0, 0), F(0, 1)), (F(1, 0), B(1, 0), W(1, 0)))
    assert split_backward(orders) == ((F(0, 0), B(0, 0), W(0, 0), F(0, 1)), orders[1])
