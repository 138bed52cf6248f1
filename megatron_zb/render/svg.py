"""SVG timeline (one lane per rank, one rect per pass) and a self-contained HTML report.

Only pass rects are ``<rect>`` elements (legend swatches are paths), so the rect count of a
drawing is its count of passes that take time. Every rect carries a ``<title>``, which browsers
show on hover. A rank with data-parallel collectives gets a second, thinner lane for them; an
all-to-all split out of a pass holds the compute stream and is drawn in the rank's lane.
The HTML page inlines the SVG without a namespace URL, so it names no outside resource at all.
"""

from __future__ import annotations

from html import escape

from ..schedule.actions import SPECS, Stream, spec
from ..schedule.simulate import PassTime, Timeline

LEFT, RIGHT, TOP, LANE, GAP, BOTTOM = 70, 20, 64, 28, 6, 36  # layout, in pixels
COLLECTIVE_LANE = 14
MIN_PASS_PX, MIN_CHART_PX, MAX_CHART_PX = 22, 400, 1600
_NS = ' xmlns="http://www.w3.org/2000/svg"'


def _px(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _num(value: float) -> str:
    return f"{value:.6g}"


def _shade(color: str, chunk: int, chunks: int) -> str:
    """Later chunks are lighter: up to halfway to white for the last one."""
    mix = 0.5 * chunk / (chunks - 1) if chunks > 1 else 0.0
    rgb = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _scale(timeline: Timeline, span: float) -> float:
    """Pixels per time unit: the shortest pass gets MIN_PASS_PX, within the chart width bounds."""
    shortest = min((t.end - t.start for rank in timeline.ranks for t in rank if t.end > t.start), default=1.0)
    if span <= 0:
        return MIN_PASS_PX / shortest
    return min(max(MIN_PASS_PX / shortest, MIN_CHART_PX / span), MAX_CHART_PX / span)


def tooltip(t: PassTime) -> str:
    p = t.pass_
    pipe = f" pipe {p.pipe}" if p.pipe else ""
    return (
        f"{p.kind.value} stage {p.stage} chunk {t.chunk} microbatch {p.microbatch}{pipe}"
        f" start {_num(t.start)} end {_num(t.end)}"
    )


def _pass(t: PassTime, x: float, width: float, y: float, chunks: int, height: float = LANE) -> list[str]:
    fill = _shade(spec(t.pass_.kind).color, t.chunk, chunks)
    out = [
        f'<rect class="pass {t.pass_.kind.value}" x="{_px(x)}" y="{_px(y)}" width="{_px(width)}" height="{height}" '
        f'fill="{fill}"><title>{escape(tooltip(t))}</title></rect>'
    ]
    label = str(t.pass_.microbatch) if t.pass_.kind.per_microbatch else f"s{t.pass_.stage}"
    if height == LANE and width >= 7 * len(label) + 4:
        out.append(f'<text class="mb" x="{_px(x + width / 2)}" y="{_px(y + LANE / 2 + 4)}">{label}</text>')
    return out


def _tick_step(scale: float) -> float:
    """The smallest 1/2/5 x 10^k time step that puts ticks at least 50 px apart."""
    return next(m * 10**e for e in range(-6, 12) for m in (1, 2, 5) if m * 10**e * scale >= 50)


def _axis(origin: float, span: float, scale: float, y: float) -> list[str]:
    step = _tick_step(scale)
    out = [f'<line class="axis" x1="{LEFT}" y1="{_px(y)}" x2="{_px(LEFT + span * scale)}" y2="{_px(y)}"/>']
    for tick in range(int(span / step + 1e-9) + 1):
        x = _px(LEFT + tick * step * scale)
        out.append(f'<line class="grid" x1="{x}" y1="{TOP - 4}" x2="{x}" y2="{_px(y + 4)}"/>')
        out.append(f'<text class="tick" x="{x}" y="{_px(y + 16)}">{_num(origin + tick * step)}</text>')
    return out


def _legend(chunks: int, kinds: set, pairs: bool = False) -> tuple[list[str], float]:
    """The legend elements and where they end (x): every compute kind, the other kinds drawn, and a note on
    overlapped pairs where there are some."""
    out, x = [], LEFT
    for kind, action in SPECS.items():
        if not (action.compute or (kind in kinds and action.stream in (Stream.COLLECTIVE, Stream.EXPERT))):
            continue
        out.append(f'<path class="swatch" d="M{x} 34h12v12h-12z" fill="{action.color}"/>')
        out.append(f'<text class="legend" x="{x + 16}" y="44">{escape(action.title)}</text>')
        x += 16 + 7 * len(action.title) + 18
    if chunks > 1:
        note = "lighter = later model chunk"
        out.append(f'<text class="legend" x="{x}" y="44">{note}</text>')
        x += 7 * len(note) + 18
    if pairs:
        note = "half-height: an overlapped F&B pair, F above B"
        out.append(f'<text class="legend" x="{x}" y="44">{escape(note)}</text>')
        x += 7 * len(note)
    return out, x


def header(timeline: Timeline) -> str:
    s = timeline.schedule
    return (
        f"{s.name}  pp={s.pp}  microbatches={s.microbatches}  chunks={s.chunks}  "
        f"makespan {_num(timeline.makespan)}  bubble {timeline.bubble_rate:.2%} (stage span), "
        f"{timeline.bubble_rate_makespan:.2%} (makespan)"
    )


_STYLE = (
    "text{font-family:sans-serif;font-size:12px;fill:#222}"
    ".mb{text-anchor:middle;pointer-events:none}.rank{text-anchor:end}.tick{text-anchor:middle;fill:#555}"
    ".header{font-size:14px;font-weight:bold}.axis{stroke:#555}.grid{stroke:#ddd}"
    ".pass{stroke:#fff;stroke-width:0.5}"
)


def _svg(timeline: Timeline, namespace: bool) -> str:
    origin = min((t.start for rank in timeline.ranks for t in rank), default=0.0)
    span = timeline.makespan
    scale = _scale(timeline, span)
    lanes = [any(spec(t.pass_.kind).stream is Stream.COLLECTIVE for t in rank) for rank in timeline.ranks]
    axis_y = TOP + len(timeline.ranks) * (LANE + GAP) + sum(lanes) * (COLLECTIVE_LANE + GAP)
    title = header(timeline)
    kinds = {t.pass_.kind for rank in timeline.ranks for t in rank}
    legend, legend_end = _legend(timeline.schedule.chunks, kinds, bool(timeline.schedule.overlapped))
    width = max(LEFT + span * scale, legend_end, LEFT + 7.5 * len(title)) + RIGHT  # text widths are estimates
    height = axis_y + BOTTOM
    body = [
        f'<svg{_NS if namespace else ""} width="{_px(width)}" height="{_px(height)}" '
        f'viewBox="0 0 {_px(width)} {_px(height)}">',
        f"<style>{_STYLE}</style>",
        f'<text class="header" x="{LEFT}" y="20">{escape(title)}</text>',
        *legend,
        *_axis(origin, span, scale, axis_y),
    ]
    y = TOP
    paired = {p: half for pair in timeline.schedule.overlapped for half, p in enumerate(pair)}
    for rank, passes in enumerate(timeline.ranks):
        body.append(f'<text class="rank" x="{LEFT - 8}" y="{_px(y + LANE / 2 + 4)}">rank {rank}</text>')
        for t in passes:
            x = LEFT + (t.start - origin) * scale
            if t.pass_ in paired:  # an overlapped pair: its forward on the upper half of one step, its backward below
                half, width = LANE / 2, (t.end - t.start) * scale
                body.extend(_pass(t, x, width, y + paired[t.pass_] * half, timeline.schedule.chunks, half))
            elif spec(t.pass_.kind).blocks_compute:
                body.extend(_pass(t, x, (t.end - t.start) * scale, y, timeline.schedule.chunks))
            elif spec(t.pass_.kind).stream is Stream.COLLECTIVE and t.end > t.start:
                below = y + LANE + GAP
                body.extend(_pass(t, x, (t.end - t.start) * scale, below, 1, COLLECTIVE_LANE))
        y += LANE + GAP + (COLLECTIVE_LANE + GAP if lanes[rank] else 0)
    body.append("</svg>")
    return "\n".join(body) + "\n"


def render_svg(timeline: Timeline) -> str:
    """A standalone SVG document of the timeline."""
    return _svg(timeline, namespace=True)


def _table(rows: list[tuple[str, ...]], head: tuple[str, ...] | None = None) -> str:
    lines = ["<table>"]
    if head:
        lines.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        lines.append(f"<tr><th>{escape(row[0])}</th>" + "".join(f"<td>{escape(c)}</td>" for c in row[1:]) + "</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def render_html(timeline: Timeline) -> str:
    """One HTML page with the SVG inlined and tables of the summary numbers; no outside resources."""
    s = timeline.schedule
    summary = [
        ("schedule", s.name),
        ("pp", str(s.pp)),
        ("microbatches", str(s.microbatches)),
        ("chunks", str(s.chunks)),
        ("makespan", _num(timeline.makespan)),
        ("stage span", _num(timeline.stage_span)),
        ("bubble rate (stage span)", f"{timeline.bubble_rate:.2%}"),
        ("bubble rate (makespan)", f"{timeline.bubble_rate_makespan:.2%}"),
    ]
    per_rank = [
        (f"rank {r}", _num(peak), _num(work), _num(timeline.rank_span(r)))
        for r, (peak, work) in enumerate(zip(timeline.peak_memory, timeline.work, strict=True))
    ]
    style = (
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin:1em 0}"
        "th,td{border:1px solid #ccc;padding:2px 10px}td{text-align:right}th{text-align:left}"
    )
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            f'<head><meta charset="utf-8"><title>{escape(s.name)} timeline</title><style>{style}</style></head>',
            "<body>",
            f"<h1>{escape(s.name)}</h1>",
            _svg(timeline, namespace=False),
            "<h2>Summary</h2>",
            _table(summary),
            "<h2>Per rank</h2>",
            _table(per_rank, ("rank", "peak memory", "busy time", "span")),
            "</body>",
            "</html>",
            "",
        ]
    )
