"""bench_runtime's W split: each block's B + W against 1F1B's fused backward of that block, ends included.

Against its stage's share alone, the V's rank 0 (embedding and loss) showed their backward as
W-split overhead and rank 1 as much again as a saving (docs/bench_runtime.md).
"""

from dataclasses import replace

import pytest

from megatron_zb.runtime.profiler import CallRecord, PassRecord
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import PassKind
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.testing.scripts import load_script
from megatron_zb.training import idle

# Per stage, seconds: B and W as measured on the V (ends on blocks 0 and 3), 1F1B's fused BW = B + W.
COSTS = CostModel(2, t_f=1.0, t_b=(0.08, 0.09), t_w=(0.06, 0.07), t_b_ends=(0.01, 0.02), t_w_ends=(0.0, 0.01))
FUSED = (0.14, 0.16)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_runtime")


def records(schedule, rank: int) -> list[PassRecord]:
    """The rank's B and W passes of iteration 0, back to back, each taking what ``COSTS`` says."""
    found, clock = [], 0.0
    for p in schedule.orders[rank]:
        if p.kind in (PassKind.B, PassKind.W):
            seconds = COSTS.duration(p, schedule.placements[p.pipe])
            found.append(PassRecord(0, p, 0, clock, clock + seconds))
            clock += seconds
    return found


def test_a_split_that_costs_what_the_fused_backward_costs_shows_none(bench):
    schedule = build("zb-v", ScheduleSpec(2, 4))
    fused = replace(COSTS, t_bw=FUSED)  # its ends: B's plus W's
    call = CallRecord(0, 0.0, 1.0, 0.0)
    for rank in (0, 1):
        assert bench.w_split(records(schedule, rank), call, schedule, fused) == pytest.approx(0.0, abs=1e-12)
    # A fused backward cheaper by 0.01 per stage: each B of a half-stage block shows half of it as the split's cost
    cheaper = replace(COSTS, t_bw=tuple(t - 0.01 for t in FUSED))
    for rank in (0, 1):
        assert bench.w_split(records(schedule, rank), call, schedule, cheaper) == pytest.approx(2 * 4 * 0.005)
    # The stage's share alone: rank 0 pays its ends' backward (4 microbatches of (0.01 + 0.03) / 2), rank 1 saves it
    shares = [idle.w_split(records(schedule, rank), schedule, FUSED) for rank in (0, 1)]
    assert shares == pytest.approx([0.08, -0.08])
