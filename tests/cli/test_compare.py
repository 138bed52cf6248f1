"""megatron-zb compare: every family at each chunk count auto searches, PyTorch's orders and auto's pick; the
best row, the Pareto frontier, the table, json and plot."""

from __future__ import annotations

import json
import random
import re
import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from megatron_zb.cli import main
from megatron_zb.compare import Comparison, Row, compare, mark_best, mark_frontier, rank_key, torch_name
from megatron_zb.render.pareto import render_pareto_svg
from megatron_zb.schedule import comm
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.torch_style import dualpipev_orders, interleaved_zb_orders, zbv_codes
from megatron_zb.schedule.generators.v_blocks import as_passes
from megatron_zb.schedule.ir import Schedule
from megatron_zb.schedule.placement import interleaved, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names
from megatron_zb.schedule.simulate import simulate

SVG_NS = "{http://www.w3.org/2000/svg}"
P, M = 4, 8
SEARCHED = (1, 2, 4)  # chunk counts auto searches when --chunks is not given
TORCH_ROWS = {
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleInterleavedZeroBubble, 2 chunks",
    "ScheduleInterleavedZeroBubble, 4 chunks",
}


def alternatives(counts: tuple[int, ...] = SEARCHED) -> set[str]:
    """The family rows: each registered non-composite schedule, at each count when it plans any number of chunks
    (named as auto names its candidates: "zb-1p, 2 chunks"; one chunk is the plain name)."""
    found = set()
    for name in names():
        generator = get(name)
        if generator.composite:
            continue
        if "chunks" not in generator.options:
            found.add(name)
            continue
        found |= {name if chunks == 1 else f"{name}, {chunks} chunks" for chunks in counts}
    return found


def picker_rows(comparison: Comparison) -> list[Row]:
    return [row for row in comparison.rows if row.family == "auto"]


@pytest.fixture(scope="module")
def unit() -> Comparison:
    return compare(ScheduleSpec(P, M))


@pytest.fixture(scope="module")
def limited() -> Comparison:
    return compare(ScheduleSpec(P, M, memory_limit=4.5))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_1f1b_row_matches_the_closed_form(unit):
    row = unit.row("1f1b")
    assert row.built and (row.chunks, row.placement) == (1, "linear")
    assert row.makespan == 3 * (M + P - 1)
    assert row.bubble_rate == pytest.approx((P - 1) / (M + P - 1))
    assert row.bubble_rate_makespan == pytest.approx((P - 1) / (M + P - 1))
    assert row.peak_memory == (4, 3, 2, 1) and row.max_peak == P
    assert row.comm_volume == 2 * (P - 1) * M


def test_zb_h1_row_matches_the_closed_form(unit):
    row = unit.row("zb-h1")
    assert row.makespan == 3 * M + P - 1
    assert row.bubble_rate == pytest.approx((P - 1) / (3 * M + P - 1))
    assert row.peak_memory[0] == P and row.max_peak == P


def test_interleaved_sends_every_block_boundary_both_ways(unit):
    for chunks in (2, 4):
        row = unit.row(f"interleaved-1f1b, {chunks} chunks")
        assert (row.chunks, row.placement, row.family) == (chunks, "interleaved", "interleaved-1f1b")
        assert row.comm_volume == 2 * (P * chunks - 1) * M
        assert row.comm_volume == comm.volume(build("interleaved-1f1b", ScheduleSpec(P, M, chunks)))


def test_1f1b_is_dominated_by_zb_h1(unit):
    assert not unit.row("1f1b").frontier
    assert unit.row("1f1b").max_peak == unit.row("zb-h1").max_peak
    assert unit.row("zb-h1").bubble_rate < unit.row("1f1b").bubble_rate


def test_frontier_is_exactly_the_undominated_rows(unit):
    points = {row.name: (round(row.max_peak, 9), round(row.bubble_rate, 9)) for row in unit.built}

    def beaten(name: str) -> bool:
        peak, bubble = points[name]
        return any(
            p <= peak and b <= bubble and (p, b) != (peak, bubble) for other, (p, b) in points.items() if other != name
        )

    assert {row.name for row in unit.built if row.frontier} == {name for name in points if not beaten(name)}
    assert any(row.frontier for row in unit.built)


def test_frontier_keeps_ties_and_drops_dominated_rows():
    def row(name: str, peak: float, bubble: float) -> Row:
        return Row(name, peak_memory=(peak,), bubble_rate=bubble)

    rows = [row("a", 4, 0.1), row("b", 4, 0.1 + 1e-12), row("c", 4, 0.2), row("d", 7, 0.0), row("e", 7, 0.1)]
    assert {r.name for r in mark_frontier(rows) if r.frontier} == {"a", "b", "d"}


def test_rows_are_sorted_by_makespan_then_span_then_peak_with_refusals_last(unit, limited):
    for comparison in (unit, limited):
        keys = [(round(row.makespan, 9), round(row.stage_span, 9), round(row.max_peak, 9)) for row in comparison.built]
        assert keys == sorted(keys)
        built = [row.built for row in comparison.rows]
        assert built == sorted(built, reverse=True)


def test_rows_are_each_family_at_every_searched_chunk_count_pytorchs_orders_and_autos_pick(unit):
    (auto,) = picker_rows(unit)
    assert {row.name for row in unit.rows} == alternatives() | TORCH_ROWS | {auto.name}
    assert len(unit.rows) == len(alternatives()) + len(TORCH_ROWS) + 1
    assert {"zb-1p", "zb-1p, 2 chunks", "zb-1p, 4 chunks", "zb-v", "v-half"} <= {row.name for row in unit.built}
    assert [row.chunks for row in (unit.row(f"zb-2p, {c} chunks") for c in (2, 4))] == [2, 4]
    assert unit.row("interleaved-1f1b").refused.startswith("interleaved-1f1b needs --chunks >= 2, got 1")
    assert {row.family for row in unit.rows if row.name in TORCH_ROWS} == {None}
    assert (unit.row("bitpipe").weight_copies, unit.row("zb-v").weight_copies) == (2, 1)


def test_pytorch_rows_are_pytorchs_orders_simulated():
    """Each PyTorch row is the order torch_style writes, on its placement, as the simulator times it."""
    comparison = compare(ScheduleSpec(P, M))
    orders = {
        "ScheduleZBVZeroBubble": (v_shape(P), as_passes(P, M, zbv_codes(P, M))),
        "ScheduleDualPipeV": (v_shape(P), dualpipev_orders(P, M)),
        **{
            f"ScheduleInterleavedZeroBubble, {v} chunks": (interleaved(P, v), interleaved_zb_orders(P, M, v))
            for v in (2, 4)
        },
    }
    for name, (placement, passes) in orders.items():
        timeline = simulate(Schedule(name, (placement,), M, tuple(map(tuple, passes))))
        row = comparison.row(name)
        assert (row.makespan, row.stage_span, row.peak_memory) == (
            timeline.makespan,
            timeline.stage_span,
            timeline.peak_memory,
        ), name
        assert row.chunks == (2 if "ZBV" in name or "DualPipeV" in name else int(name.split(", ")[1][0]))


def test_torch_name_is_pytorchs_class_name():
    assert torch_name("PyTorch's DualPipeV order") == "ScheduleDualPipeV"
    assert torch_name("PyTorch's InterleavedZeroBubble order, 4 chunks") == "ScheduleInterleavedZeroBubble, 4 chunks"


def test_best_is_the_shortest_makespan_that_fits_and_includes_autos_pick(unit):
    # unit costs: every rank computes 3M, and the last rank starts (P-1) forwards of a 1/4 stage late, so no
    # schedule with at most 4 chunks per rank ends before 3M + (P-1)/4; the best reach it
    best = unit.best
    assert {row.makespan for row in best} == {3 * M + (P - 1) / 4}
    assert all(row.chunks == 4 and row.weight_copies == 1 for row in best)
    (auto,) = picker_rows(unit)
    assert auto.best and auto.name.startswith("auto (")
    picked = auto.name.removeprefix("auto (").removesuffix(")")
    assert unit.row(picked).best and rank_key(unit.row(picked)) == rank_key(auto)
    ranked = [row for row in unit.built if row.weight_copies == 1]
    assert all(rank_key(best[0]) <= rank_key(row) for row in ranked)
    # BitPipe keeps two copies of the weights: faster here, but not ranked (auto does not search it)
    assert unit.row("bitpipe-zb").makespan < best[0].makespan and not unit.row("bitpipe-zb").best


def test_best_with_post_validation_ranks_stage_span_first():
    comparison = compare(ScheduleSpec(P, M, post_validation=True))
    best = comparison.best
    assert {row.stage_span for row in best} == {3 * M}  # zero stage-span bubble
    assert {row.makespan for row in best} == {3 * M + (P - 1) / 4}
    zero_span = [row for row in comparison.built if row.weight_copies == 1 and row.stage_span == 3 * M]
    assert min(row.makespan for row in zero_span) == best[0].makespan
    assert any(row.family == "auto" for row in best)
    assert "best = ranked first as auto ranks: shortest stage span, then makespan" in comparison.to_text()


def test_mark_best_keeps_ties_and_skips_rows_with_more_weights():
    def row(name: str, makespan: float, span: float, peak: float, copies: int = 1) -> Row:
        return Row(name, makespan=makespan, stage_span=span, peak_memory=(peak,), weight_copies=copies)

    rows = [row("a", 10, 9, 4), row("b", 10, 9, 4 + 1e-12), row("c", 10, 9, 5), row("d", 9, 9, 4, copies=2)]
    assert {r.name for r in mark_best(rows) if r.best} == {"a", "b"}
    rows.append(row("e", 11, 8, 4))
    assert {r.name for r in mark_best(rows, post_validation=True) if r.best} == {"e"}


def test_memory_limit_refuses_what_does_not_fit(limited):
    (auto,) = picker_rows(limited)
    assert {row.name for row in limited.rows} == alternatives() | TORCH_ROWS | {auto.name}
    refused = limited.row("zb-h2")
    assert refused.refused == "zb-h2 needs --memory-limit >= 7 for pp=4, microbatches=8, got 4.5"
    assert limited.row("zb-2p, 4 chunks").refused == "zb-2p needs --memory-limit >= 5 for pp=4, microbatches=8, got 4.5"
    assert {"1f1b", "zb-h1", "ScheduleDualPipeV", "zb-1p, 4 chunks"} <= {row.name for row in limited.built}
    assert all(row.max_peak <= 4.5 for row in limited.built)
    assert auto.max_peak <= 4.5 and auto.best


def test_pytorch_orders_over_the_limit_are_refused_with_the_memory_they_need():
    comparison = compare(ScheduleSpec(P, M, memory_limit=4.25))
    assert comparison.row("ScheduleDualPipeV").refused == (
        "ScheduleDualPipeV needs --memory-limit >= 4.5 for pp=4, microbatches=8, got 4.25"
    )
    assert comparison.row("ScheduleZBVZeroBubble").built


def test_requested_chunks_apply_to_every_schedule():
    comparison = compare(ScheduleSpec(P, M, chunks=2))
    assert comparison.row("1f1b").refused.startswith("1f1b runs one chunk per rank, got --chunks 2")
    assert comparison.row("interleaved-1f1b, 2 chunks").chunks == 2
    (auto,) = picker_rows(comparison)
    torch_rows = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleInterleavedZeroBubble, 2 chunks"}
    assert {row.name for row in comparison.rows} == alternatives((2,)) | torch_rows | {auto.name}
    assert all(row.chunks == 2 for row in comparison.built)


def drawn_settings(count: int, seed: int = 40) -> list[ScheduleSpec]:
    """Settings like issue 40's (small enough for seconds): uneven stages (first x1.4, last x1.6), T_B/T_F 0.9-2.2,
    T_W/T_B 0.2-1.0, communication up to a quarter of a forward; the last with post-validation."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        pp = rng.randint(3, 4)
        t_f = [round(rng.uniform(0.8, 1.2), 2) for _ in range(pp)]
        t_f[0], t_f[-1] = round(t_f[0] * 1.4, 2), round(t_f[-1] * 1.6, 2)
        b, w = rng.uniform(0.9, 2.2), rng.uniform(0.2, 1.0)
        costs = CostModel(
            pp,
            t_f=tuple(t_f),
            t_b=tuple(round(f * b, 3) for f in t_f),
            t_w=tuple(round(f * b * w, 3) for f in t_f),
            t_comm=round(rng.uniform(0.0, 0.25), 2),
        )
        specs.append(ScheduleSpec(pp, rng.randint(pp, 2 * pp), costs=costs, post_validation=i == count - 1))
    return specs


def pytorch_orders(spec: ScheduleSpec) -> list[Schedule]:
    """PyTorch's orders that run the setting, written out here from torch_style (not through compare)."""
    p, m = spec.pp, spec.microbatches
    found = [Schedule("zbv", (v_shape(p),), m, tuple(map(tuple, as_passes(p, m, zbv_codes(p, m)))))]
    if m >= 2 * p:
        found.append(Schedule("dualpipev", (v_shape(p),), m, tuple(map(tuple, dualpipev_orders(p, m)))))
    found += [
        Schedule(f"izb{v}", (interleaved(p, v),), m, tuple(map(tuple, interleaved_zb_orders(p, m, v)))) for v in (2, 4)
    ]
    return found


DRAWN = drawn_settings(4)


@pytest.mark.parametrize("spec", DRAWN, ids=[f"{i}-pp{s.pp}-m{s.microbatches}" for i, s in enumerate(DRAWN)])
def test_best_row_is_never_worse_than_auto_or_a_pytorch_order_at_its_memory(spec):
    """Issue 40's acceptance: at no limit and at each PyTorch order's own peak, compare's best row is at least as
    good as auto's schedule and as every PyTorch order that fits, on what sets the iteration time."""
    costs = spec.cost_model()
    timed = [simulate(schedule, costs) for schedule in pytorch_orders(spec)]
    first = (lambda t: (t.stage_span, t.makespan)) if spec.post_validation else (lambda t: (t.makespan, t.stage_span))
    for limit in sorted({None, *(max(t.peak_memory) for t in timed)}, key=lambda v: v or 0.0):
        limited = replace(spec, memory_limit=limit)
        (best, *_) = compare(limited).best
        rivals = [t for t in timed if limit is None or max(t.peak_memory) <= limit + 1e-9]
        rivals.append(simulate(build("auto", limited), costs))
        for rival in rivals:
            assert first(best) <= tuple(v + 1e-9 for v in first(rival)), (limit, best.name, rival.schedule.name)


def table_lines(text: str) -> dict[str, str]:
    """Each table row by the schedule it names (names may hold single spaces; columns are two apart)."""
    table = text.split("\n\n")[1].splitlines()
    start = table[0].index("schedule")
    return {re.split(r" {2,}", line[start:])[0]: line for line in table[1:]}


def refused_names(text: str) -> set[str]:
    body = text.split("\n\n")
    if len(body) < 3:
        return set()
    assert body[2].startswith("refused:")
    return {re.split(r" {2,}", line.strip())[0] for line in body[2].splitlines()[1:]}


def test_table_lists_every_row_and_marks_the_best_and_the_frontier(unit, limited):
    text = unit.to_text()
    assert text.splitlines()[:4] == [
        "megatron-zb compare  pp=4  microbatches=8  chunks=searched  memory limit=none",
        "bubble = stage-span bubble rate, bubble(ms) = makespan bubble rate, comm = cross-rank transfers per iteration",
        "peak = activation memory in one microbatch's activations of a stage; * = on the Pareto frontier of "
        "(peak, bubble)",
        "best = ranked first as auto ranks: shortest makespan, then stage span, then lowest peak; not ranked, for "
        "their copies of the weights: bitpipe (2), bitpipe-zb (2)",
    ]
    lines = table_lines(text)
    assert set(lines) | refused_names(text) == {row.name for row in unit.rows}
    assert {name for name, line in lines.items() if line.startswith("best")} == {row.name for row in unit.best}
    assert {name for name, line in lines.items() if line[6] == "*"} == {row.name for row in unit.built if row.frontier}
    assert lines["1f1b"].split() == ["1f1b", "1", "linear", "33", "27.27%", "27.27%", "4", "4,3,2,1", "48"]
    limited_text = limited.to_text()
    assert "memory limit=4.5" in limited_text.splitlines()[0]
    assert set(table_lines(limited_text)) | refused_names(limited_text) == {row.name for row in limited.rows}
    assert "\nrefused:\n" in limited_text
    assert re.search(
        r"^  zb-h2 +zb-h2 needs --memory-limit >= 7 for pp=4, microbatches=8, got 4.5$", limited_text, re.M
    )


def test_cli_json_has_every_row_with_its_fields(capsys):
    code, out, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--memory-limit", "4.5", "--format", "json")
    assert code == 0
    result = json.loads(out)
    assert (result["pp"], result["microbatches"], result["chunks"], result["memory_limit"]) == (4, 8, None, 4.5)
    assert result["costs"]["t_f"] == [1.0] * 4
    rows = {row["schedule"]: row for row in result["rows"]}
    (auto,) = [name for name, row in rows.items() if row["family"] == "auto"]
    assert set(rows) == alternatives() | TORCH_ROWS | {auto}
    assert rows["1f1b"] == {
        "schedule": "1f1b",
        "family": "1f1b",
        "refused": None,
        "chunks": 1,
        "placement": "linear",
        "makespan": 33,
        "stage_span": 33,
        "bubble_rate": pytest.approx(3 / 11),
        "bubble_rate_makespan": pytest.approx(3 / 11),
        "peak_memory": [4, 3, 2, 1],
        "max_peak_memory": 4,
        "comm_volume": 48,
        "weight_copies": 1,
        "pareto_frontier": False,
        "best": False,
        "overlapped_pairs": 0,
    }
    assert rows["zb-h2"]["refused"].startswith("zb-h2 needs --memory-limit >= 7")
    assert rows["zb-h2"]["makespan"] is None and rows["zb-h2"]["pareto_frontier"] is False
    assert rows[auto]["best"] and result["post_validation"] is False
    assert rows["ScheduleZBVZeroBubble"]["family"] is None


def test_cli_text_to_a_file(capsys, tmp_path):
    target = tmp_path / "compare.txt"
    code, out, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--cost-comm", "0.1", "-o", str(target))
    assert code == 0 and out == ""
    text = target.read_text()
    assert set(table_lines(text)) | refused_names(text) >= alternatives() | TORCH_ROWS


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--mem-b", "-0.7"], "mem_f + mem_b + mem_w (--mem-f/--mem-b/--mem-w) = -0.2, must be 0"),
        (["--cost-f", "1,2"], "t_f (--cost-f) has 2 values; give one number or one per stage"),
        (["--plot", "x.pdf"], "--plot writes .svg or .png files, got 'x.pdf'"),
    ],
)
def test_cli_refuses_bad_settings(capsys, extra, message):
    code, out, err = run(capsys, "compare", "--pp", "4", "-m", "8", *extra)
    assert code == 2 and out == ""
    assert err.startswith("megatron-zb compare: error: ") and message in err


def svg_points(text: str) -> list[ET.Element]:
    root = ET.fromstring(text)
    return [e for e in root.iter(f"{SVG_NS}circle") if "point" in e.get("class", "").split()]


def test_plot_has_one_marker_per_built_schedule(capsys, tmp_path):
    target = tmp_path / "pareto.svg"
    code, _, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--memory-limit", "4.5", "--plot", str(target))
    assert code == 0
    limited = compare(ScheduleSpec(P, M, memory_limit=4.5))
    points = svg_points(target.read_text())
    assert len(points) == len(limited.built)
    frontier = [e for e in points if "frontier" in e.get("class").split()]
    assert len(frontier) == sum(row.frontier for row in limited.built)
    assert sorted(e.find(f"{SVG_NS}title").text.split(":")[0] for e in points) == sorted(
        row.name for row in limited.built
    )
    root = ET.fromstring(target.read_text())
    assert [e.get("class") for e in root.iter(f"{SVG_NS}line") if e.get("class") == "limit"] == ["limit"]


def test_plot_without_limit_or_schedules_is_still_an_svg(unit):
    svg = render_pareto_svg(unit)
    assert len(svg_points(svg)) == len(unit.built)
    assert 'class="limit"' not in svg
    nothing = compare(ScheduleSpec(P, M, memory_limit=0.5))
    assert not nothing.built and svg_points(render_pareto_svg(nothing)) == []


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="rsvg-convert is not installed")
def test_plot_png_through_rsvg_convert(capsys, tmp_path):
    target = tmp_path / "pareto.png"
    code, _, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--plot", str(target))
    assert code == 0 and target.read_bytes().startswith(b"\x89PNG")


def test_plan_refine_seconds_zero_is_the_default(capsys):
    argv = ["plan", "--schedule", "zb-h1", "--pp", "4", "-m", "8", "--format", "json"]
    _, default, _ = run(capsys, *argv)
    code, zero, _ = run(capsys, *argv, "--refine-seconds", "0")
    assert code == 0 and zero == default


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_plan_refuses_a_bad_refine_budget(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--schedule", "zb-h1", "--pp", "4", "-m", "8", "--refine-seconds", value])
    assert exit_.value.code == 2
    assert "megatron-zb plan: error: argument --refine-seconds" in capsys.readouterr().err
