"""Trailing Ws moved into idle gaps (generators/v_tail.py): nothing else moves, the ranks that end last end earlier."""

from __future__ import annotations

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.result import model_of, timed_codes
from megatron_zb.schedule.generators.torch_style import zbv_codes
from megatron_zb.schedule.generators.v_tail import sunk_tail
from megatron_zb.schedule.placement import v_shape
from megatron_zb.schedule.timing import run

# scripts/bench_vs_reference.py's setting #48 (seed 4040): pp 4, m 14, heavy ends, comm a fifth of T_F
T_F = (1.3436, 1.1797, 1.1601, 1.6475)
COSTS = CostModel(
    4,
    t_f=T_F,
    t_b=[1.206 * x for x in T_F],
    t_w=[0.9719 * 1.206 * x for x in T_F],
    t_comm=0.2482,
    mem_f=1,
    mem_b=-0.55,
    mem_w=-0.45,
)


def test_trailing_ws_fill_gaps_and_nothing_else_moves():
    plain = timed_codes(zbv_codes(4, 14), v_shape(4), COSTS, 14)
    sunk = sunk_tail(plain, COSTS)
    assert sunk is not None
    assert sunk.stage_span == pytest.approx(73.038133478, abs=1e-8) == plain.stage_span
    assert (plain.makespan, sunk.makespan) == pytest.approx((73.979497630, 73.732693883), abs=1e-8)
    assert sunk.peak == plain.peak == 4.0
    model = model_of((v_shape(4),), 14, COSTS)
    before, after = run(model, plain.codes), run(model, sunk.codes)
    m = 14
    for rank, (old, new) in enumerate(zip(plain.codes, sunk.codes, strict=True)):
        assert sorted(old) == sorted(new)
        for code in old:  # every pass something waits for keeps its start
            if model.awaited[code // m]:
                assert after.start[code] == pytest.approx(before.start[code], abs=1e-9)
        moved = sum(model.duration(w) for w in old if new.index(w) < old.index(w))
        assert after.free[rank] == pytest.approx(before.free[rank] - moved, abs=1e-9)
    # rank 3, the last to end, moved four of the Ws after its last B into waits before it (2.74 time units)
    assert [before.free[3], after.free[3]] == pytest.approx([73.979497630, 71.236991376], abs=1e-8)
    assert after.free[0] == before.free[0]  # rank 0 never waits late: its Ws stay


def test_no_gap_holds_a_w():
    """Equal unit costs: no trailing W fits a wait of the PyTorch-style order, so nothing moves (None)."""
    plain = timed_codes(zbv_codes(4, 14), v_shape(4), CostModel(4), 14)
    assert sunk_tail(plain, CostModel(4)) is None
