"""PyTorch's schedule CSV: our orders round-trip through it, torch reads ours, we read torch's, with or without comms.

The reader and writer are pure Python; the tests that check them against PyTorch itself import
torch (2.13 in the .venv) and build its schedules with stand-in stages, without a process group.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_zb.schedule.generators.torch_style import dualpipev_orders, interleaved_zb_orders, zbv_codes
from megatron_zb.schedule.generators.v_blocks import as_passes
from megatron_zb.schedule.ir import Schedule, ScheduleError, parse_orders
from megatron_zb.schedule.lower import DataParallel, lower
from megatron_zb.schedule.placement import interleaved, linear, mirrored, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, names
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.torch_csv import read_torch_csv, write_torch_csv
from megatron_zb.schedule.validate import check
from megatron_zb.testing.scripts import load_script

DOCS = Path(__file__).resolve().parents[2] / "docs"


def settings() -> list[tuple[int, int, int | None]]:
    return [(pp, m, chunks) for pp in (2, 3, 4) for m in (1, pp, 2 * pp + 1) for chunks in (None, 2, 4)]


@pytest.mark.parametrize("name", names())
def test_every_registered_schedule_round_trips(name):
    built = 0
    for pp, m, chunks in settings():
        try:
            schedule = build(name, ScheduleSpec(pp, m, chunks), suggest=False)
        except ScheduleError:
            continue  # a setting this schedule refuses
        if len(schedule.placements) > 1:  # BitPipe: PyTorch's CSV holds one pipe (test_two_pipes_cannot_be_written)
            built += 1
            continue
        back, notes = read_torch_csv(write_torch_csv(schedule), "back")
        assert (back.placements, back.microbatches, back.orders) == (
            schedule.placements,
            schedule.microbatches,
            schedule.orders,
        ), (pp, m, chunks)
        assert notes == []
        built += 1
    assert built >= 4, f"{name} built only {built} settings"


def test_each_action_maps_to_our_pass():
    text = "0F0,0F1,,0I0,0W0,0B1\n1F0,1B0,1F1,1I1,1W1\n"
    schedule, notes = read_torch_csv(text, "mapped")
    assert schedule.placements == (linear(2),) and schedule.microbatches == 2 and notes == []
    assert schedule.orders == parse_orders(
        "rank 0: F s0 mb0, F s0 mb1, B s0 mb0, W s0 mb0, BW s0 mb1\n"
        "rank 1: F s1 mb0, BW s1 mb0, F s1 mb1, B s1 mb1, W s1 mb1"
    )
    assert write_torch_csv(schedule) == text.replace(",,", ",")


def test_overlapped_actions_run_one_after_the_other():
    text = "0F0,3F0,3I0,(0F1;3B0)OVERLAP_F_B,3F1,3B1,0I0,0W0,0B1\n1F0,2F0,2I0,1F1,2W0,2F1,2B1,1I0,1W0,1B1\n"
    schedule, _ = read_torch_csv(text, "dualpipe-like")
    assert schedule.placements == (v_shape(2),)
    assert [str(p) for p in schedule.orders[0][:5]] == ["F s0 mb0", "F s3 mb0", "B s3 mb0", "F s0 mb1", "BW s3 mb0"]


def stand_in_stages(pp: int, stages: int) -> list[SimpleNamespace]:
    """What torch's schedule constructors read from rank 0's stages (they plan every rank)."""
    return [
        SimpleNamespace(num_stages=stages, group_size=pp, group_rank=0, stage_index=i, submod=None)
        for i in range(stages // pp)
    ]


@pytest.mark.parametrize(
    "name, chunks", [("1f1b", None), ("zb-h1", None), ("zb-v", None), ("zb-2p", 2), ("interleaved-1f1b", 4)]
)
def test_torch_loads_our_export_and_lowers_it_without_deadlock(name, chunks, tmp_path):
    from torch.distributed.pipelining import schedules as torch_schedules

    ours = build(name, ScheduleSpec(4, 8, chunks))
    path = tmp_path / f"{name}.csv"
    path.write_text(write_torch_csv(ours))
    theirs = torch_schedules._PipelineScheduleRuntime(stand_in_stages(4, ours.placement.num_stages), n_microbatches=8)
    theirs._load_csv(str(path))
    assert theirs.stage_index_to_group_rank == {s: ours.placement.rank_of(s) for s in range(ours.placement.num_stages)}
    assert [[str(a) for a in theirs.pipeline_order[r]] for r in range(4)] == [
        [re.sub(r"^(BW|F|B|W) s(\d+) mb(\d+)$", _torch_text, str(p)) for p in order] for order in ours.orders
    ]
    lowered = {
        rank: [a for a in actions if a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
        for rank, actions in theirs.pipeline_order_with_comms.items()
    }
    torch_schedules._simulate_comms_compute(
        lowered, lambda s: theirs.stage_index_to_group_rank[s], ours.placement.num_stages
    )


def _torch_text(found: re.Match) -> str:
    kind, stage, mb = found.groups()
    return f"{stage}{ {'F': 'F', 'B': 'I', 'W': 'W', 'BW': 'B'}[kind] }{mb}"


@pytest.mark.parametrize(
    "cls, per_rank", [("ScheduleInterleavedZeroBubble", 2), ("ScheduleZBVZeroBubble", 2), ("ScheduleDualPipeV", 2)]
)
def test_reads_torchs_dump_with_comms_as_its_compute_only_dump(cls, per_rank, tmp_path):
    from torch.distributed.pipelining import schedules as torch_schedules

    theirs = getattr(torch_schedules, cls)(stand_in_stages(4, 4 * per_rank), 8)
    theirs._dump_csv(str(tmp_path / "compute.csv"), format="compute_only")
    theirs._dump_csv(str(tmp_path / "comms.csv"), format="compute_comms")
    comms = (tmp_path / "comms.csv").read_text()
    compute, none = read_torch_csv((tmp_path / "compute.csv").read_text(), cls)
    with_comms, notes = read_torch_csv(comms, cls)
    compute_only = tuple(tuple(p for p in order if p.kind.is_compute) for order in with_comms.orders)
    assert none == [] and compute_only == compute.orders
    sends = len(re.findall(r"(SEND|RECV)_[FB]\d", comms))
    assert notes == [
        f"{sends} SEND/RECV actions agree with the compute order and were dropped: megatron-zb derives its messages "
        "from the compute order"
    ]
    # PyTorch's lowering's UNSHARD/RESHARD/REDUCE_GRAD are ours: kept, and valid under our rules
    kept = {p.kind.value for order in with_comms.orders for p in order if not p.kind.is_compute}
    assert kept == {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
    check(with_comms)
    assert simulate(compute).makespan > 0


# -- refusals -----------------------------------------------------------------------------------
LOOP = "0F0,0I0,0W0,2F0,2I0,2W0\n1F0,1I0,1W0,3F0,3I0,3W0\n"  # not a valid order, but a loop placement
H1 = "0F0,0I0,0W0\n1F0,1I0,1W0\n"


def refusal(text: str) -> str:
    with pytest.raises(ScheduleError) as error:
        read_torch_csv(text, "t.csv")
    return str(error.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "t.csv: no rows; expected one row of actions per pipeline rank"),
        ("0F0,0X0\n", "rank 0 step 1: cannot read '0X0'; expected PyTorch's [stage][type][microbatch], e.g. 2F0"),
        ("0F0,1F0\n1I0\n", "t.csv: rank 1 step 0 (1I0): stage 1 also runs on rank 0"),
        ("0F0,3F0\n1F0\n", "t.csv: no rank runs stage(s) [2]; every stage needs its passes"),
        ("0F\n", "t.csv: rank 0 step 0 (0F) names no microbatch"),
        ("(0F0;1SEND_F0)OVERLAP_F_B\n", "rank 0 step 0: OVERLAP_F_B may hold compute actions only, got 1SEND_F0"),
        ("0F0,1F0\n2F0,3F0\n", "is neither PyTorch's 'loop' style (stage s on rank s % 2) nor its 'v' style"),
        ("0F0,1F0,2F0\n3F0\n", "t.csv: ranks hold different numbers of stages (rank 0: 3, rank 1: 1)"),
    ],
)
def test_unreadable_files_are_refused(text, message):
    assert message in refusal(text)


def test_placement_refusal_names_the_mapping():
    assert refusal("0F0,1F0\n2F0,3F0\n") == (
        "t.csv: the stage -> rank mapping {0: 0, 1: 0, 2: 1, 3: 1} is neither PyTorch's 'loop' style (stage s on rank "
        "s % 2) nor its 'v' style (down the ranks and back up); megatron-zb places model chunks only those ways"
    )
    assert read_torch_csv(LOOP)[0].placements == (interleaved(2, 2),)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "0F0,0SEND_F0,0I0,0W0\n1RECV_F0,1F0,1I0,1W0\n",
            "the communication is incomplete: no 0RECV_B0 on rank 0 (2 missing); give every transfer, or a "
            "compute-only CSV",
        ),
        (
            "0SEND_F0,0F0,0I0,0W0\n1RECV_F0,1F0,1I0,1W0\n",
            "rank 0 step 0 (0SEND_F0) sends before its tensor is computed",
        ),
        ("0F0,0SEND_F0,0I0,0W0\n1F0,1RECV_F0,1I0,1W0\n", "rank 1 step 1 (1RECV_F0) receives after the pass that needs"),
        ("0F0,0SEND_F1,0I0,0W0\n1F0,1I0,1W0\n", "rank 0 step 1 (0SEND_F1) matches no cross-rank transfer"),
        ("0F0,0SEND_F0,0SEND_F0,0I0,0W0\n1F0,1I0,1W0\n", "rank 0 step 2 (0SEND_F0) repeats rank 0 step 1 (0SEND_F0)"),
        ("0F0,1SEND_F0,0I0,0W0\n1F0,1I0,1W0\n", "rank 0 step 1 (1SEND_F0): stage 1 does not run on rank 0"),
        ("0F0,0I0,0REDUCE_GRAD,0W0\n1F0,1I0,1W0\n", "(0REDUCE_GRAD) reduces the gradients before the last backward"),
    ],
)
def test_comm_and_data_parallel_actions_must_agree_with_the_compute_order(text, message):
    assert message in refusal(text)


def test_data_parallel_actions_become_ours_and_round_trip():
    text = "0UNSHARD,0F0,0I0,0W0,0REDUCE_GRAD,0RESHARD\n1F0,1I0,1W0\n"
    schedule, notes = read_torch_csv(text, "t.csv")
    assert notes == []
    assert schedule.to_text().splitlines()[0] == (
        "rank 0: UNSHARD s0, F s0 mb0, B s0 mb0, W s0 mb0, REDUCE_GRAD s0, RESHARD s0"
    )
    check(schedule)
    assert write_torch_csv(schedule) == text
    lowered = lower(build("breadth-first-zb", ScheduleSpec(2, 4)), DataParallel(gather="windows"))
    back, _ = read_torch_csv(write_torch_csv(lowered), "back")
    assert back.orders == lowered.orders


def test_replica_syncs_have_no_pytorch_action():
    lowered = lower(build("bitpipe", ScheduleSpec(2, 2)), DataParallel())
    with pytest.raises(ScheduleError, match="runs 2 pipes"):
        write_torch_csv(lowered)


def test_two_pipes_cannot_be_written():
    first = linear(2)
    both = Schedule("bidirectional", (first, mirrored(first)), 2, ((), ()))
    with pytest.raises(ScheduleError, match="bidirectional runs 2 pipes \\(bidirectional\\); PyTorch's CSV holds one"):
        write_torch_csv(both)


# -- PyTorch's own orders: what docs/bench_vs_pytorch.md reports -------------------------------
def independent_makespan(schedule: Schedule, gpt_like: bool) -> float:
    """A second simulator written from the execution model, not from ``execute``: ranks run their
    passes in order; a pass starts when its rank is free and its inputs are done (+0.05 across ranks)."""
    pp, stages = schedule.pp, schedule.placement.num_stages
    per_rank = stages // pp

    def cost(p) -> float:
        full = p.stage // per_rank
        f = 1.2 if gpt_like and full in (0, pp - 1) else 1.0
        b, w = (1.1, 0.7) if gpt_like else (1.0, 1.0)
        return {"F": f, "B": b, "W": w, "BW": b + w}.get(p.kind.value, 0.0) / per_rank  # actions: free here

    def needs(p) -> list[tuple[str, int]]:
        if p.kind.value == "F":
            return [("F", p.stage - 1)] if p.stage else []
        if p.kind.value == "W":
            return [("B", p.stage)]
        return [("F", p.stage)] + ([("B", p.stage + 1)] if p.stage < stages - 1 else [])

    done: dict[tuple[str, int, int], float] = {}
    free, cursor = [0.0] * pp, [0] * pp
    while any(cursor[r] < len(schedule.orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while cursor[r] < len(schedule.orders[r]):
                p = schedule.orders[r][cursor[r]]
                inputs = [(kind, stage, p.microbatch) for kind, stage in needs(p)]
                if any(key not in done for key in inputs):
                    break
                latency = 0.05 if gpt_like else 0.0
                ready = [done[key] + (latency if schedule.placement.rank_of(key[1]) != r else 0.0) for key in inputs]
                end = max([free[r], *ready]) + cost(p)
                for role in ("B", "W") if p.kind.value == "BW" else (p.kind.value,):
                    done[role, p.stage, p.microbatch] = end
                free[r], cursor[r], moved = end, cursor[r] + 1, True
        assert moved, "deadlock"
    return max(free)


def bench_rows() -> list[tuple[str, int, int, str, int, str]]:
    """(costs, p, m, PyTorch schedule, stages per rank, makespan) of every simulated row of the page."""
    rows, section = [], None
    for line in (DOCS / "bench_vs_pytorch.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            heading = re.match(r"^## (.+) costs, p=(\d+)$", line)
            section = (heading.group(1), int(heading.group(2))) if heading else None
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if section and len(cells) == 10 and cells[0].isdigit() and cells[3] != "—":
            rows.append((*section, int(cells[0]), cells[1], int(cells[2]), cells[8]))
    return rows


def test_pytorch_orders_import_validate_and_simulate_to_the_benchmark_makespans(tmp_path):
    """Multi-stage schedules go through torch's own ``_dump_csv``; the single-stage ones have none."""
    from torch.distributed.pipelining import schedules as torch_schedules

    bench = load_script("bench_vs_pytorch")
    rows = bench_rows()
    assert len(rows) >= 500 and {row[3] for row in rows} == set(bench.TORCH_SCHEDULES)
    assert {row[0] for row in rows} == set(bench.COSTS)
    imported: dict[tuple, Schedule] = {}  # the same order under every cost profile
    for costs, p, m, name, per_rank, makespan in rows:
        if (p, m, name, per_rank) not in imported:
            if per_rank > 1:
                built = getattr(torch_schedules, name)(stand_in_stages(p, p * per_rank), m)
                built._dump_csv(str(tmp_path / "t.csv"), format="compute_only")
                text = (tmp_path / "t.csv").read_text()
            else:
                text = bench.dump_csv(bench.torch_order(name, p, m, per_rank))
            schedule, _ = read_torch_csv(text, name)
            check(schedule)
            assert schedule.orders == bench.imported(name, p, m, per_rank).orders
            # its OVERLAP_F_B steps are overlapped pairs; the page times them one after the other, as
            # PyTorch's runtime runs them without a registered overlap function
            assert bool(schedule.overlapped) == ("OVERLAP_F_B" in text)
            imported[p, m, name, per_rank] = replace(schedule, overlapped=())
        schedule = imported[p, m, name, per_rank]
        timeline = simulate(schedule, bench.COSTS[costs](p))
        assert f"{timeline.makespan:.6g}" == makespan, (costs, p, m, name, per_rank)
        if costs in ("unit", "GPT-like"):  # the costs the second simulator knows
            assert independent_makespan(schedule, costs == "GPT-like") == pytest.approx(timeline.makespan)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_pytorch_orders_we_seed_with_are_pytorchs(p):
    """torch_style.py writes ZB-V, DualPipeV and interleaved zero bubble from their phase structure;
    ``auto`` and the families start from them, so they must be exactly what PyTorch runs."""
    bench = load_script("bench_vs_pytorch")
    compared = 0
    for m in (p, 2 * p, 2 * p + 1, 3 * p, 5 * p + 3):
        ours = {("ScheduleZBVZeroBubble", 2): as_passes(p, m, zbv_codes(p, m))}
        if m >= 2 * p:
            ours["ScheduleDualPipeV", 2] = dualpipev_orders(p, m)
        for chunks in (2, 4):
            ours["ScheduleInterleavedZeroBubble", chunks] = interleaved_zb_orders(p, m, chunks)
        for (name, per_rank), orders in ours.items():
            try:
                theirs = bench.imported(name, p, m, per_rank)
            except ValueError as error:
                assert "multiple of the number of rounds" in str(error)  # PyTorch refuses; ours runs any m
                continue
            assert theirs.orders == tuple(map(tuple, orders)), (name, p, m, per_rank)
            compared += 1
    assert compared >= 8


def test_schedule1f1b_pipeline_order_misses_the_last_ranks_first_forward():
    """Why the benchmark builds Schedule1F1B's executed order: its pipeline_order differs on the last rank only."""
    from torch.distributed.pipelining.schedules import Schedule1F1B

    bench = load_script("bench_vs_pytorch")
    listed = Schedule1F1B(SimpleNamespace(num_stages=4), 8).pipeline_order
    executed = bench.executed_1f1b(4, 8)
    compute = [[str(a) for a in listed[r] if a is not None and a.computation_type.value in "FB"] for r in range(4)]
    assert compute[:3] == [[str(a) for a in executed[r]] for r in range(3)]
    assert compute[3][:2] == ["3F1", "3B0"] and [str(a) for a in executed[3][:2]] == ["3F0", "3B0"]
