"""megatron-zb compare: every schedule for one setting, the Pareto frontier, the table, json and plot."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET

import pytest

from megatron_zb.cli import main
from megatron_zb.compare import Comparison, Row, compare, mark_frontier
from megatron_zb.render.pareto import render_pareto_svg
from megatron_zb.schedule import comm
from megatron_zb.schedule.registry import ScheduleSpec, build, get, names

SVG_NS = "{http://www.w3.org/2000/svg}"
P, M = 4, 8


def alternatives() -> set[str]:
    """What compare must list: every registered schedule that is not a composite picker."""
    return {name for name in names() if not get(name).composite}


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
    row = unit.row("interleaved-1f1b")
    assert (row.chunks, row.placement) == (2, "interleaved")
    assert row.comm_volume == 2 * (P * row.chunks - 1) * M
    assert row.comm_volume == comm.volume(build("interleaved-1f1b", ScheduleSpec(P, M)))


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


def test_rows_are_sorted_by_bubble_then_peak_with_refusals_last(unit, limited):
    for comparison in (unit, limited):
        keys = [(round(row.bubble_rate, 9), round(row.max_peak, 9)) for row in comparison.built]
        assert keys == sorted(keys)
        built = [row.built for row in comparison.rows]
        assert built == sorted(built, reverse=True)


def test_every_non_composite_schedule_gets_a_row(unit):
    assert {row.name for row in unit.rows} == alternatives()
    assert len(unit.rows) == len(alternatives())


def test_memory_limit_refuses_what_does_not_fit(limited):
    assert {row.name for row in limited.rows} == alternatives()
    refused = limited.row("zb-h2")
    assert refused.refused.startswith("zb-h2 needs --memory-limit >= 7 for pp=4, microbatches=8, got 4.5")
    assert "\n" not in refused.refused
    assert {"1f1b", "zb-h1"} <= {row.name for row in limited.built}
    assert all(row.max_peak <= 4.5 for row in limited.built)


def test_requested_chunks_apply_to_every_schedule():
    comparison = compare(ScheduleSpec(P, M, chunks=2))
    assert comparison.row("1f1b").refused.startswith("1f1b runs one chunk per rank, got --chunks 2")
    assert comparison.row("interleaved-1f1b").chunks == 2


def table_names(text: str) -> set[str]:
    """The schedule named on each table row and each refusal line."""
    body = text.split("\n\n")
    table = body[1].splitlines()[1:]  # after the column header
    found = {line.lstrip("*").split()[0] for line in table}
    if len(body) > 2:
        assert body[2].startswith("refused:")
        found |= {line.split()[0] for line in body[2].splitlines()[1:]}
    return found


def test_table_lists_every_schedule_and_marks_the_frontier(unit, limited):
    text = unit.to_text()
    assert text.splitlines()[0] == "megatron-zb compare  pp=4  microbatches=8  chunks=default  memory limit=none"
    assert table_names(text) == alternatives()
    marked = {line.split()[1] for line in text.splitlines() if line.startswith("* ")}
    assert marked == {row.name for row in unit.built if row.frontier}
    assert "1f1b" not in marked
    limited_text = limited.to_text()
    assert "memory limit=4.5" in limited_text.splitlines()[0]
    assert table_names(limited_text) == alternatives()
    assert "\nrefused:\n" in limited_text
    assert re.search(r"^  zb-h2 +zb-h2 needs --memory-limit >= 7", limited_text, re.MULTILINE)


def test_cli_json_has_every_row_with_its_fields(capsys):
    code, out, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--memory-limit", "4.5", "--format", "json")
    assert code == 0
    result = json.loads(out)
    assert (result["pp"], result["microbatches"], result["chunks"], result["memory_limit"]) == (4, 8, None, 4.5)
    assert result["costs"]["t_f"] == [1.0] * 4
    rows = {row["schedule"]: row for row in result["rows"]}
    assert set(rows) == alternatives()
    assert rows["1f1b"] == {
        "schedule": "1f1b",
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
        "pareto_frontier": False,
    }
    assert rows["zb-h2"]["refused"].startswith("zb-h2 needs --memory-limit >= 7")
    assert rows["zb-h2"]["makespan"] is None and rows["zb-h2"]["pareto_frontier"] is False


def test_cli_text_to_a_file(capsys, tmp_path):
    target = tmp_path / "compare.txt"
    code, out, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--cost-comm", "0.1", "-o", str(target))
    assert code == 0 and out == ""
    assert table_names(target.read_text()) == alternatives()


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
