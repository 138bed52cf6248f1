"""Renderers: exact text for a tiny case, one SVG rect and one trace event per pass, no outside resources."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_zb.render import FORMATS, render_chrome_trace, render_html, render_svg, render_text
from megatron_zb.render.svg import tooltip
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import Timeline, simulate

SVG_NS = "{http://www.w3.org/2000/svg}"
CASES = [
    ("1f1b", ScheduleSpec(2, 2)),
    ("zb-h1", ScheduleSpec(4, 8)),
    ("zb-h2", ScheduleSpec(4, 8)),
    ("interleaved-1f1b", ScheduleSpec(4, 8, chunks=2)),
]

EXPECTED_1F1B = """\
rank 0 |F0F1....BW0-..BW1-|
rank 1 |..F0BW0-F1BW1-....|
time    0         5
legend: F3 forward of microbatch 3 | B3 backward (input grad) | W3 backward (weight grad) | BW3 fused B+W
        lowercase: odd model chunk | - pass continues | . idle | narrow passes: F B W, X = BW

schedule     1f1b  pp=2  microbatches=2  chunks=1
makespan     9  stage span 9
bubble rate  33.33% (stage span)  33.33% (makespan)
peak memory  rank 0: 2  rank 1: 1
scale        1 column = 0.5 time units
"""


def timeline(name: str, spec: ScheduleSpec, costs: CostModel | None = None) -> Timeline:
    return simulate(build(name, spec), costs)


def all_passes(tl: Timeline) -> list:
    return [t for rank in tl.ranks for t in rank]


@pytest.fixture(params=CASES, ids=[name for name, _ in CASES])
def any_timeline(request) -> Timeline:
    name, spec = request.param
    return timeline(name, spec, CostModel(spec.pp, t_f=1, t_b=1.5, t_w=0.5, t_comm=0.1))


# text


def test_text_exact_1f1b():
    assert render_text(timeline("1f1b", ScheduleSpec(2, 2))) == EXPECTED_1F1B


def test_text_rows_show_every_pass_in_order(any_timeline):
    rows = render_text(any_timeline).splitlines()[: any_timeline.schedule.pp]
    for rank, (row, passes) in enumerate(zip(rows, any_timeline.ranks, strict=True)):
        assert row.startswith(f"rank {rank} |") and row.endswith("|")
        labels = re.findall(r"[A-Za-z]+\d+", row.split("|")[1])
        expected = [f"{t.pass_.kind.value}{t.pass_.microbatch}" for t in passes]
        expected = [label.lower() if t.chunk % 2 else label for label, t in zip(expected, passes, strict=True)]
        assert labels == expected


def test_text_width_caps_rows():
    text = render_text(timeline("zb-h1", ScheduleSpec(4, 8)), width=40)
    rows = text.splitlines()[:4]
    assert [len(row) for row in rows] == [40] * 4
    assert "1 column = 0.870968 time units" in text


def test_text_color_only_adds_ansi_codes():
    tl = timeline("zb-h1", ScheduleSpec(4, 8))
    colored = render_text(tl, color=True)
    assert "\x1b[34mF0\x1b[0m" in colored
    assert re.sub(r"\x1b\[\d+m", "", colored) == render_text(tl)


# svg / html


def test_svg_one_rect_with_tooltip_per_pass(any_timeline):
    root = ET.fromstring(render_svg(any_timeline))
    rects = root.iter(f"{SVG_NS}rect")
    titles = sorted(rect.find(f"{SVG_NS}title").text for rect in rects)
    assert titles == sorted(tooltip(t) for t in all_passes(any_timeline))
    assert render_svg(any_timeline).count("<rect") == len(all_passes(any_timeline))


def test_svg_rect_geometry_follows_time():
    tl = timeline("zb-h1", ScheduleSpec(4, 8), CostModel(4, t_f=1, t_b=2, t_w=0.5, t_comm=0.25))
    rects = list(ET.fromstring(render_svg(tl)).iter(f"{SVG_NS}rect"))
    passes = all_passes(tl)
    assert len(rects) == len(passes)
    first, last = passes[0], max(passes, key=lambda t: t.start)
    left = float(rects[0].get("x"))
    scale = (float(rects[passes.index(last)].get("x")) - left) / (last.start - first.start)
    for rect, t in zip(rects, passes, strict=True):
        assert float(rect.get("x")) == pytest.approx(left + (t.start - first.start) * scale, abs=0.02)
        assert float(rect.get("width")) == pytest.approx((t.end - t.start) * scale, abs=0.02)
        assert t.pass_.kind.value in rect.get("class").split()


def test_svg_header_and_escaping():
    tl = timeline("zb-h2", ScheduleSpec(4, 8))
    svg = render_svg(tl)
    assert f"{tl.bubble_rate:.2%} (stage span)" in svg and f"{tl.bubble_rate_makespan:.2%} (makespan)" in svg
    odd = dataclasses.replace(tl, schedule=dataclasses.replace(tl.schedule, name='a<b>&"c'))
    svg, html = render_svg(odd), render_html(odd)
    ET.fromstring(svg)
    assert "a&lt;b&gt;&amp;&quot;c" in svg and "a<b>" not in svg and "a<b>" not in html


def test_html_is_self_contained(any_timeline):
    html = render_html(any_timeline)
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "</svg>" in html
    for external in ("http://", "https://", "src=", "href=", "url(", "@import"):
        assert external not in html
    assert f"{any_timeline.bubble_rate:.2%}" in html
    for rank in range(any_timeline.schedule.pp):
        assert f"<tr><th>rank {rank}</th>" in html


# chrome trace


@pytest.mark.parametrize("unit", [1000.0, 250.0])
def test_chrome_trace_one_event_per_pass(any_timeline, unit):
    trace = render_chrome_trace(any_timeline, time_unit_us=unit)
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in events if e["ph"] == "X"]
    passes = all_passes(any_timeline)
    assert len(complete) == len(passes)
    for event, t in zip(complete, passes, strict=True):
        assert event["pid"] == 0 and event["tid"] == t.rank
        assert event["ts"] == t.start * unit and event["dur"] == (t.end - t.start) * unit
        assert event["name"] == f"{t.pass_.kind.value} mb{t.pass_.microbatch}"
        assert event["args"] == {"stage": t.pass_.stage, "chunk": t.chunk, "microbatch": t.pass_.microbatch, "pipe": 0}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {rank: f"rank {rank}" for rank in range(any_timeline.schedule.pp)}
    sort = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    assert sort == {rank: rank for rank in range(any_timeline.schedule.pp)}


def test_chrome_trace_memory_counters_and_json():
    tl = timeline("zb-h1", ScheduleSpec(4, 8))
    trace = json.loads(FORMATS["chrome-trace"](tl))
    assert trace == render_chrome_trace(tl)
    for rank, levels in enumerate(tl.memory):
        counter = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == f"activation memory rank {rank}"]
        assert [e["args"]["memory"] for e in counter] == [0.0, *levels]
        assert [e["ts"] for e in counter[1:]] == [t.end * 1000.0 for t in tl.ranks[rank]]


# package


def test_formats_return_strings():
    tl = timeline("1f1b", ScheduleSpec(2, 2))
    assert set(FORMATS) == {"text", "svg", "html", "chrome-trace"}
    assert FORMATS["text"](tl) == EXPECTED_1F1B
    assert all(isinstance(render(tl), str) for render in FORMATS.values())


def test_render_imports_only_stdlib_and_schedule():
    package = Path(__file__).resolve().parents[2] / "megatron_zb" / "render"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 or (node.module or "").startswith("schedule"), (path.name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert all(n.split(".")[0] in sys.stdlib_module_names for n in names), (path.name, names)
