"""Solver refinement: never worse than its input, and optimal on cases small enough to solve by hand."""

import importlib.util
import subprocess
import sys

import pytest

from megatron_zb.schedule import placement
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import B, F, Pass, PassKind, Schedule, ScheduleError, W, parse_orders
from megatron_zb.schedule.refine import _scale, refine
from megatron_zb.schedule.registry import ScheduleSpec, build, peak_memory
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import validate

needs_ortools = pytest.mark.skipif(importlib.util.find_spec("ortools") is None, reason="needs the refine extra")
SECONDS = 5  # a ceiling: these models are solved to optimality in well under a second


def deferred_w(pp: int, microbatches: int) -> Schedule:
    """1F1B with the backward split and every W left to the end of its rank: valid, but poor."""
    orders = []
    for rank in range(pp):
        warmup = min(pp - 1 - rank, microbatches)
        order: list[Pass] = [F(rank, mb) for mb in range(warmup)]
        for mb in range(microbatches):
            if warmup + mb < microbatches:
                order.append(F(rank, warmup + mb))
            order.append(B(rank, mb))
        orders.append(tuple(order + [W(rank, mb) for mb in range(microbatches)]))
    return Schedule("deferred-w", (placement.linear(pp),), microbatches, tuple(orders))


def eager_w(pp: int, microbatches: int) -> Schedule:
    """1F1B with the backward split and each W right after its B: 1F1B's order and memory."""
    orders = []
    for order in deferred_w(pp, microbatches).orders:
        eager: list[Pass] = []
        for p in order[:-microbatches]:
            eager += [p, W(p.stage, p.microbatch)] if p.kind is PassKind.B else [p]
        orders.append(tuple(eager))
    return Schedule("eager-w", (placement.linear(pp),), microbatches, tuple(orders))


def assert_refined(refined: Schedule, schedule: Schedule, costs: CostModel, memory_limit: float | None) -> float:
    """Same passes on every rank, valid within the limit; returns the refined stage span."""
    assert [sorted(order) for order in refined.orders] == [sorted(order) for order in schedule.orders]
    assert validate(refined, costs, memory_limit) == []
    if memory_limit is not None:
        assert peak_memory(refined, costs) <= memory_limit + 1e-9
    return simulate(refined, costs).stage_span


@pytest.fixture
def no_ortools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)


@pytest.mark.usefixtures("no_ortools")
@pytest.mark.parametrize("seconds", [0, -1])
def test_no_time_returns_the_input_without_ortools(seconds: float):
    schedule = deferred_w(2, 4)
    assert refine(schedule, CostModel(2), None, seconds) is schedule


@pytest.mark.usefixtures("no_ortools")
def test_missing_ortools_names_the_extra():
    with pytest.raises(ScheduleError, match=r"pip install 'megatron-zb\[refine\]'"):
        refine(deferred_w(2, 4), CostModel(2), None, 1)


def test_importing_refine_does_not_import_ortools():
    code = "import sys, megatron_zb.schedule.refine; print('ortools' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_scale_is_exact_for_simple_fractions():
    assert _scale([1.2, 1.0, 0.6], [0.05], 100) == 20
    assert _scale([0.5, 1 / 3, 0.0], [], 100) == 6
    # Not simple fractions: the smallest of the first values gets the resolution, the rest is rounded.
    assert _scale([3.14159265358979, 10.0], [0.001], 1000) == 319


@needs_ortools
@pytest.mark.parametrize(
    ("pp", "before", "best"),
    [
        # pp=2 by hand. Deferred Ws: rank 0 F0 F1 [0,2] B0 [3,4] F2 B1 F3 [4,7] B2 [7,8] B3 [9,10] Ws [10,14].
        # Best: rank 0 F0..F2 [0,3] B0 F3 B1 W0 B2 W1 B3 W2 W3 [3,12]; rank 1 runs 1..13 with no gap,
        # 12 = the work of a rank, so nothing is shorter.
        (2, 14, 12),
        # pp=3. Deferred Ws: rank 0 ends B2 [9,10] B3 [11,12] Ws [12,16]. Best: rank 0's first B waits
        # for F, F, F, B, B down the pipe and back (5 units after its first F) while only its 4 Fs can
        # run, so it idles at least 1: 12 + 1.
        (3, 16, 13),
    ],
)
def test_deferred_ws_are_moved_into_the_bubbles(pp: int, before: float, best: float):
    schedule, costs, limit = deferred_w(pp, 4), CostModel(pp), 4.0
    assert simulate(schedule, costs).stage_span == before
    assert assert_refined(refine(schedule, costs, limit, SECONDS), schedule, costs, limit) == best


@needs_ortools
@pytest.mark.parametrize(("limit", "best"), [(None, 12), (3.0, 12), (2.0, 13)])
def test_memory_limit_is_respected(limit: float | None, best: float):
    # Limit 2: rank 0 can run only F0 and F1 (2 units) before its first B, which starts 3 units after
    # F0 at the earliest, so it idles at least 1 and 13 is the best (ZB-H1 reaches it). Limit 3 lets it
    # run F2 in that gap: 12, the work of a rank. The input itself keeps each W next to its B: 14.
    schedule, costs = eager_w(2, 4), CostModel(2)
    assert simulate(schedule, costs).stage_span == 14
    assert peak_memory(schedule, costs) == 2
    assert assert_refined(refine(schedule, costs, limit, SECONDS), schedule, costs, limit) == best


@needs_ortools
def test_never_worse_than_zb_h1():
    costs = CostModel(3, t_f=(1.2, 1, 1.2), t_b=1, t_w=0.6, t_comm=0.05)
    schedule = build("zb-h1", ScheduleSpec(3, 6, costs=costs))
    before = simulate(schedule, costs).stage_span
    assert assert_refined(refine(schedule, costs, None, 2), schedule, costs, None) <= before
    # Within ZB-H1's own memory the solver finds nothing shorter, so the input comes back.
    assert refine(schedule, costs, peak_memory(schedule, costs), 2) is schedule


@needs_ortools
def test_v_shape_placement():
    # pp=2, V placement: rank 0 holds blocks 0 and 3, rank 1 blocks 1 and 2; a pass costs 0.5.
    schedule = Schedule(
        "v-deferred-w",
        (placement.v_shape(2),),
        2,
        parse_orders(
            """
            rank 0: F s0 mb0, F s0 mb1, F s3 mb0, B s3 mb0, F s3 mb1, B s3 mb1, B s0 mb0, B s0 mb1, \
                    W s3 mb0, W s3 mb1, W s0 mb0, W s0 mb1
            rank 1: F s1 mb0, F s1 mb1, F s2 mb0, F s2 mb1, B s2 mb0, B s2 mb1, B s1 mb0, B s1 mb1, \
                    W s2 mb0, W s2 mb1, W s1 mb0, W s1 mb1
            """
        ),
    )
    costs = CostModel(2)
    # Rank 0: F s0 F s0 [0,1], F s3 B s3 F s3 B s3 [2,4], B s0 B s0 [5,6] (after rank 1's B s1), Ws [6,8].
    assert simulate(schedule, costs).stage_span == 8
    # Rank 0 works 6 units; before its first F s3 (1.5 after its first F s0) it can only run its two
    # F s0 (1 unit), so it idles at least 0.5: 6.5 is the best.
    assert assert_refined(refine(schedule, costs, None, SECONDS), schedule, costs, None) == 6.5
