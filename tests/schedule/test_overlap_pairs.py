"""Overlapped F&B pairs (``Schedule.overlapped``): their time, the engine, lowering, the planner, files, the CLI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from megatron_zb.cli import main
from megatron_zb.compare import compare
from megatron_zb.render import render_text
from megatron_zb.render.svg import render_svg
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.costs_file import MeasuredCosts, load_costs, save_costs
from megatron_zb.schedule.execute import DeadlockError, execute
from megatron_zb.schedule.generators.auto import hidden_at_most
from megatron_zb.schedule.generators.search import time_bound
from megatron_zb.schedule.generators.torch_style import dualpipev_orders, dualpipev_pairs
from megatron_zb.schedule.ir import BW, B, F, PassKind, Schedule, ScheduleError, W
from megatron_zb.schedule.iterations import repeat, simulate_iterations
from megatron_zb.schedule.lower import DataParallel, lower
from megatron_zb.schedule.pairing import overlap_pairs, screened
from megatron_zb.schedule.placement import linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names
from megatron_zb.schedule.schedule_file import read_json
from megatron_zb.schedule.serialise import schedule_from_data, schedule_to_data
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.torch_csv import read_torch_csv, write_torch_csv
from megatron_zb.schedule.validate import check, validate

V2 = (v_shape(2),)


def _hand_made() -> Schedule:
    """pp 2, two microbatches, F B W split; rank 1 runs B0 beside F1."""
    orders = (
        (F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)),
        (F(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 0), W(1, 1)),
    )
    return Schedule("hand", (linear(2),), 2, orders, overlapped=((F(1, 1), B(1, 0)),))


@pytest.mark.parametrize(
    ("overlap", "backward", "expected"),
    [
        (1.0, B(0, 0), 5 - 1.5),  # hides min(a_f + a_b, c_f + c_b) = min(1.5, 3.5): max(c, a) = 3.5
        (0.5, B(0, 0), 5 - 0.75),
        (0.0, B(0, 0), 5.0),
        (-1.0, B(0, 0), 5 + 1.5),  # a pair slower than its passes
        (1.0, BW(0, 0), 6 - 1.5),  # the BW's W is compute: c_b = 3 + 1 - 1
    ],
)
def test_pair_time_is_both_passes_less_the_share_of_what_hides(overlap, backward, expected):
    costs = CostModel(2, t_f=2.0, t_b=3.0, t_w=1.0, t_a2a=0.5, t_a2a_b=1.0, overlap=overlap)
    assert costs.pair_time(F(0, 1), backward, (linear(2),)) == pytest.approx(expected)
    heavy = CostModel(2, t_f=2.0, t_b=3.0, t_a2a=2.0, t_a2a_b=2.5)  # a = 4.5 > c = 0.5: the all-to-all is longer
    assert heavy.pair_time(F(0, 1), B(0, 0), (linear(2),)) == pytest.approx(4.5)
    assert CostModel(2, t_f=2.0, t_b=3.0).pair_time(F(0, 1), B(0, 0), (linear(2),)) == 5.0  # nothing to hide
    halves = CostModel(2, t_f=2.0, t_b=3.0, t_a2a=0.5, t_a2a_b=1.0)  # a V block is half a stage
    assert halves.pair_time(F(0, 1), B(3, 0), V2) == pytest.approx((5 - 1.5) / 2)


@pytest.mark.parametrize("overlap", [1.5, -1.01, float("nan"), True, (0.5,)])
def test_an_overlap_outside_minus_one_to_one_is_refused_naming_the_flag(overlap):
    with pytest.raises(ScheduleError, match=r"overlap \(--cost-overlap\) must be a number from -1 to 1"):
        CostModel(2, overlap=overlap)


def test_costs_file_carries_the_overlap_and_old_files_read_as_one(tmp_path):
    path = tmp_path / "costs.json"
    save_costs(path, MeasuredCosts(CostModel(2, t_a2a=0.25, overlap=0.6)))
    assert load_costs(path).costs.overlap == 0.6
    data = json.loads(path.read_text())
    del data["costs"]["overlap"]
    path.write_text(json.dumps(data))
    assert load_costs(path).costs.overlap == 1.0


def test_a_hand_made_pair_runs_as_one_step_with_its_exact_timeline():
    costs = CostModel(2, t_a2a=0.5)  # pair time 2 - min(1, 1) = 1
    timeline = simulate(_hand_made(), costs)
    spans = [[(t.start, t.end) for t in rank] for rank in timeline.ranks]
    assert spans[0] == [(0, 1), (1, 2), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert spans[1] == [(1, 2), (2, 3), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert timeline.work == (6.0, 5.0)  # the pair's one span counted once
    assert timeline.makespan == 7.0
    # execute's default: a pair takes its two passes' time (no gain), still one step
    default = execute(_hand_made(), lambda p: 1.0)
    assert [(s.start, s.end) for s in default[1][:3]] == [(1, 2), (2, 4), (2, 4)]
    marked = [a for a in timeline.to_dict()["ranks"][1] if "pair" in a]
    assert [(a["pass"], a["microbatch"], a["pair"]) for a in marked] == [("B", 0, 0), ("F", 1, 0)]


def test_a_pair_whose_backward_needs_its_forward_is_a_deadlock_naming_it():
    own = Schedule("own", (linear(1),), 1, ((F(0, 0), B(0, 0), W(0, 0)),), overlapped=((F(0, 0), B(0, 0)),))
    with pytest.raises(DeadlockError, match=r"overlapped pair \(F s0 mb0, B s0 mb0\) on rank 0: B s0 mb0 needs F s0"):
        simulate(own, CostModel(1))
    # through rank 1: B s0 needs B s1 <- B s2 <- B s3 <- F s3, which runs beside it
    orders = (
        (F(0, 0), B(0, 0), F(3, 0), B(3, 0), W(3, 0), W(0, 0)),
        (F(1, 0), F(2, 0), B(2, 0), B(1, 0), W(1, 0), W(2, 0)),
    )
    around = Schedule("around", V2, 1, orders, overlapped=((F(3, 0), B(0, 0)),))
    with pytest.raises(DeadlockError, match=r"rank 0 is at overlapped pair \(F s3 mb0, B s0 mb0\)"):
        simulate(around, CostModel(2))
    [issue] = validate(around)
    assert issue.rule == "pair"
    assert "overlapped pair (F s3 mb0, B s0 mb0): B s0 mb0 needs F s3 mb0 through B s1 mb0, B s2 mb0, B s3 mb0" in (
        issue.message
    )


def _paired(name: str, costs: CostModel, pp: int = 4, m: int = 8) -> tuple[Schedule, Schedule]:
    plain = build(name, ScheduleSpec(pp, m, costs=costs))
    return plain, overlap_pairs(plain, costs)


@pytest.mark.parametrize("gather", ["none", "once", "windows"])
def test_lowering_keeps_pairs_adjacent_and_their_all_to_alls_inside(gather):
    costs = CostModel(4, t_a2a=0.3, t_dp=0.2, mem_param=0.5)
    _, schedule = _paired("zb-v", costs)
    assert len({schedule.chunk_of(f) != schedule.chunk_of(b) for f, b in schedule.overlapped}) == 1  # two chunks
    lowered = lower(schedule, DataParallel(gather=gather), costs)  # Schedule refuses a pair no longer adjacent
    assert lowered.overlapped == schedule.overlapped
    check(lowered, costs)
    paired = {p for pair in schedule.overlapped for p in pair}
    split = {
        (p.stage, p.microbatch, p.kind) for order in lowered.orders for p in order if p.kind.value.startswith("A2A")
    }
    for order in schedule.orders:
        for p in order:
            part = {PassKind.F: PassKind.A2A_F}.get(p.kind, PassKind.A2A_B)
            if p.kind is not PassKind.W:
                assert ((p.stage, p.microbatch, part) in split) == (p not in paired), p
    unpaired = lower(_paired("zb-v", costs)[0], DataParallel(gather=gather), costs)
    assert simulate(lowered, costs).makespan <= simulate(unpaired, costs).makespan + 1e-9


def test_a_reduction_due_between_a_pairs_passes_follows_the_pair():
    """Lowering alone (no validation): the stage's last weight gradient is the pair's first pass."""
    partial = Schedule("partial", (linear(1),), 2, ((F(0, 0), BW(0, 0), F(0, 1)),), overlapped=((F(0, 1), BW(0, 0)),))
    lowered = lower(partial, DataParallel(), CostModel(1, t_a2a=0.25))
    assert lowered.to_text() == "rank 0: A2A_F s0 mb0, F s0 mb0, BW s0 mb0, F s0 mb1, REDUCE_GRAD s0"


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-auto", "interleaved-1f1b", "zb-2p", "bitpipe"])
@pytest.mark.parametrize("a2a", [0.1, 0.3])
def test_pairs_never_lengthen_a_schedule(name, a2a):
    costs = CostModel(4, t_a2a=a2a, t_comm=0.05)
    plain, paired = _paired(name, costs)
    check(paired, costs)
    assert paired.orders == plain.orders
    assert simulate(paired, costs).makespan <= simulate(plain, costs).makespan + 1e-9
    stage_first = overlap_pairs(plain, costs, "stage_span")
    assert simulate(stage_first, costs).stage_span <= simulate(plain, costs).stage_span + 1e-9


@pytest.mark.parametrize(("name", "before", "after"), [("zb-v", 25.5, 25.2), ("interleaved-1f1b", 28.5, 25.2)])
def test_pairs_shorten_where_the_all_to_all_is_large(name, before, after):
    costs = CostModel(4, t_a2a=0.3)
    plain, paired = _paired(name, costs)
    assert (simulate(plain, costs).makespan, simulate(paired, costs).makespan) == pytest.approx((before, after))


def test_1f1b_gains_nothing_from_adjacent_pairs():
    """Each F and BW next to each other in 1F1B sit on one chain across ranks: one step for both delays it."""
    costs = CostModel(4, t_a2a=0.3)
    plain, paired = _paired("1f1b", costs)
    assert paired is plain and simulate(plain, costs).makespan == 33.0  # pairs that only tie are not placed


def test_the_dualpipev_order_starts_from_pytorchs_pairs():
    costs = CostModel(4, t_a2a=0.3)
    orders = tuple(map(tuple, dualpipev_orders(4, 8)))
    plain = Schedule("dualpipev", (v_shape(4),), 8, orders)
    seeds = dualpipev_pairs(4, 8)
    assert len(seeds) == 25 and all(abs(o.index(f) - o.index(b)) == 1 for f, b in seeds for o in orders if f in o)
    paired = overlap_pairs(plain, costs)
    assert set(seeds) <= set(paired.overlapped)
    assert simulate(plain, costs).makespan == 25.5
    assert simulate(paired, costs).makespan == pytest.approx(24.0)
    assert simulate(replace(plain, overlapped=tuple(seeds)), costs).makespan == pytest.approx(24.0)


@pytest.mark.parametrize(
    "costs", [CostModel(4), CostModel(4, t_a2a=0.3, overlap=0.0), CostModel(4, t_a2a=0.3, overlap=-0.5)]
)
def test_no_pair_without_all_to_all_time_to_hide(costs):
    plain, paired = _paired("zb-v", costs)
    assert paired is plain and not paired.overlapped


def test_the_spec_asks_for_pairs_and_build_places_them():
    costs = CostModel(4, t_a2a=0.3)
    spec = ScheduleSpec(4, 8, costs=costs, overlap_f_b=True)
    built = build("zb-v", spec)
    assert built.overlapped == overlap_pairs(build("zb-v", replace(spec, overlap_f_b=False)), costs).overlapped
    assert len(built.overlapped) == 22
    assert not build("zb-v", replace(spec, costs=CostModel(4))).overlapped  # nothing to hide


def test_files_keep_the_pairs():
    costs = CostModel(4, t_a2a=0.3)
    _, schedule = _paired("zb-v", costs)
    assert schedule_from_data(json.loads(json.dumps(schedule_to_data(schedule)))).overlapped == schedule.overlapped
    plan = read_json(json.dumps(simulate(schedule, costs).to_dict()), "plan.json")
    assert (plan.orders, set(plan.overlapped)) == (schedule.orders, set(schedule.overlapped))
    text = write_torch_csv(schedule)
    assert text.count("OVERLAP_F_B") == len(schedule.overlapped)
    assert "(0F7;0I0)OVERLAP_F_B" in text.splitlines()[0]
    csv_schedule, _ = read_torch_csv(text)
    assert (csv_schedule.orders, set(csv_schedule.overlapped)) == (schedule.orders, set(schedule.overlapped))


def test_a_torch_overlap_of_other_contents_still_runs_in_turn():
    text = "0F0,1F0,(1I0;0F1)OVERLAP_F_B,1W0,0I0,0W0,1F1,1I1,1W1,0I1,0W1\n"
    schedule, _ = read_torch_csv(text.replace("(1I0;0F1)", "(1I0;1W0)").replace(",1W0,", ",0F1,"))
    assert not schedule.overlapped
    paired, _ = read_torch_csv(text)
    assert paired.overlapped == ((F(0, 1), B(1, 0)),)


def test_pictures_show_a_pair():
    costs = CostModel(2, t_a2a=0.5)
    timeline = simulate(_hand_made(), costs)
    text = render_text(timeline)
    assert "B0&F1" in text.splitlines()[1] and "pairs        1 overlapped F&B pairs" in text
    svg = ET.fromstring(render_svg(timeline))
    halves = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.get("height") == "14.0"]
    assert len(halves) == 2 and len({r.get("x") for r in halves}) == 1


def test_plan_and_compare_place_pairs(capsys):
    argv = ["plan", "--schedule", "zb-v", "--pp", "4", "--microbatches", "8", "--cost-a2a", "0.3"]
    assert main([*argv, "--overlap-f-b", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["overlapped_pairs"], plan["makespan"]) == (22, pytest.approx(25.2))
    assert main([*argv, "--overlap-f-b", "--cost-overlap", "0"]) == 0
    assert "pairs" not in capsys.readouterr().out.split("legend")[1]
    assert main([*argv[:7], "--overlap-f-b"]) == 2
    assert "--overlap-f-b hides the expert-parallel all-to-all, and the costs have none" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse refuses it by name
        main([*argv, "--cost-overlap", "2"])
    assert "argument --cost-overlap: must be in [-1, 1], got 2" in capsys.readouterr().err
    spec = ScheduleSpec(4, 8, costs=CostModel(4, t_a2a=0.3), overlap_f_b=True)
    rows = {row.name: row for row in compare(spec).built}
    assert (rows["zb-v"].pairs, rows["ScheduleDualPipeV"].pairs) == (22, 25)
    assert rows["ScheduleDualPipeV"].makespan == pytest.approx(24.0)
    assert main(["compare", "--pp", "4", "-m", "8", "--cost-a2a", "0.3", "--overlap-f-b"]) == 0
    assert "pairs = overlapped F&B pairs" in capsys.readouterr().out


def test_repeated_iterations_keep_the_pairs_and_time_them_as_pairs():
    costs = CostModel(4, t_a2a=0.3)
    paired = build("zb-v", ScheduleSpec(4, 8, costs=costs, overlap_f_b=True))
    twice = repeat(paired, 2)
    assert len(twice.overlapped) == 2 * len(paired.overlapped)
    assert twice.overlapped[len(paired.overlapped)][0].microbatch == paired.overlapped[0][0].microbatch + 8
    check(twice)
    assert simulate(twice, costs).makespan < simulate(replace(twice, overlapped=()), costs).makespan
    plain = simulate_iterations(replace(paired, overlapped=()), costs, 3).period
    assert simulate_iterations(paired, costs, 3).period < plain


# pp 8, m 32, t_a2a 0.3: without pairs auto picks zb-2p with 4 chunks (97.75), with them interleaved-1f1b (85.8)
PAIRED_8 = ScheduleSpec(8, 32, costs=CostModel(8, t_a2a=0.3), overlap_f_b=True)


def test_auto_ranks_its_candidates_paired_so_no_paired_family_or_compare_row_beats_it():
    costs = PAIRED_8.costs
    auto = build("auto", PAIRED_8)
    makespan = simulate(auto, costs).makespan
    assert (auto.name, len(auto.overlapped)) == ("auto (interleaved-1f1b, 4 chunks)", 768)
    assert makespan == pytest.approx(85.8)
    for family in names():
        if get(family).composite or get(family).weight_copies > 1:
            continue
        try:
            paired = build(family, PAIRED_8)  # at its default chunks
        except ScheduleError:
            continue  # interleaved-1f1b's default at pp 8 is 2 chunks; one that cannot run this setting
        assert simulate(paired, costs).makespan >= makespan - 1e-9, family
    comparison = compare(PAIRED_8)
    assert min(row.makespan for row in comparison.built if row.weight_copies == 1) == pytest.approx(makespan)
    assert comparison.row(auto.name).best and comparison.row("interleaved-1f1b, 4 chunks").best


def test_v_auto_ranks_its_seeds_paired_so_no_paired_v_family_or_dualpipev_beats_it():
    costs = PAIRED_8.costs
    v_auto = build("v-auto", PAIRED_8)
    makespan = simulate(v_auto, costs).makespan
    plain = build("v-auto", replace(PAIRED_8, overlap_f_b=False))
    assert (simulate(plain, costs).makespan, makespan) == (99.5, pytest.approx(86.8))  # the DualPipeV order, paired
    for family in ("zb-v", "v-half", "v-min"):
        assert simulate(build(family, PAIRED_8), costs).makespan >= makespan - 1e-9, family
    dualpipev = Schedule("dualpipev", (v_shape(8),), 32, tuple(map(tuple, dualpipev_orders(8, 32))))
    assert simulate(overlap_pairs(dualpipev, costs), costs).makespan == pytest.approx(makespan)


def test_without_pairs_to_place_auto_and_v_auto_plan_as_before():
    plain = replace(PAIRED_8, overlap_f_b=False)
    auto = build("auto", plain)
    assert (auto.name, simulate(auto, plain.costs).makespan, auto.overlapped) == ("auto (zb-2p, 4 chunks)", 97.75, ())
    for name in ("auto", "v-auto"):  # no all-to-all to hide: the very plan without the flag
        no_a2a = ScheduleSpec(8, 32, overlap_f_b=True)
        assert build(name, no_a2a) is build(name, replace(no_a2a, overlap_f_b=False))


def test_with_post_validation_auto_ranks_paired_stage_spans_first():
    spec = ScheduleSpec(4, 8, costs=CostModel(4, t_a2a=0.3), overlap_f_b=True, post_validation=True)
    auto = build("auto", spec)
    span = simulate(auto, spec.costs).stage_span
    assert (auto.name, span) == ("auto (interleaved-1f1b, 4 chunks)", pytest.approx(23.4))
    comparison = compare(spec)
    assert min(row.stage_span for row in comparison.built if row.weight_copies == 1) == pytest.approx(span)


@pytest.mark.parametrize(
    ("name", "chunks", "plain", "screen", "paired"),
    [
        ("zb-2p", None, 27.0, 25.2, 24.6),  # the greedy gains beyond the best whole set
        ("interleaved-1f1b", 4, 26.25, 23.4, 23.4),  # every F first: already the best
        ("1f1b", None, 33.0, 33.0, 33.0),  # no pair gains
    ],
)
def test_screening_bounds_what_the_pairs_reach(name, chunks, plain, screen, paired):
    costs = CostModel(4, t_a2a=0.3)
    schedule = build(name, ScheduleSpec(4, 8, chunks=chunks, costs=costs))
    placed = overlap_pairs(schedule, costs)
    assert simulate(schedule, costs).makespan == plain
    assert screened(schedule, costs)[0] == pytest.approx(screen)
    assert simulate(placed, costs).makespan == pytest.approx(paired)
    spans = screened(schedule, costs, "stage_span")
    assert simulate(overlap_pairs(schedule, costs, "stage_span"), costs).stage_span <= spans[0] + 1e-9
    with pytest.raises(ScheduleError, match="already has overlapped pairs"):
        screened(_hand_made(), CostModel(2, t_a2a=0.5))


@pytest.mark.parametrize(("name", "chunks"), [("zb-2p", None), ("interleaved-1f1b", 4), ("zb-v", None)])
def test_pairs_beat_a_placements_time_bound_by_no_more_than_auto_allows_for(name, chunks):
    """``auto`` refuses a family unplanned only when even all of its all-to-all hidden cannot get it under the best."""
    costs = CostModel(4, t_a2a=0.3, t_a2a_b=0.5)
    spec = ScheduleSpec(4, 8, chunks=chunks, costs=costs, overlap_f_b=True)
    assert hidden_at_most(spec) == pytest.approx(8 * 0.8 + 4 * 0.3)
    paired = build(name, spec)
    bound = time_bound(costs, paired.placements[0], 8)
    assert bound - hidden_at_most(spec) - 1e-9 <= simulate(paired, costs).makespan < bound  # below the plain bound
