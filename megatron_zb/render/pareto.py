"""SVG scatter of a Comparison: stage-span bubble against max peak memory, one point per schedule.

Each built schedule is one ``<circle class="point ...">`` (nothing else in the drawing is a
circle), labelled with its name; the Pareto frontier is a step line through its points and
the memory limit, when there is one, a dashed vertical line. Pure stdlib, no outside resources.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Protocol


class Point(Protocol):
    """What is drawn of one schedule (a ``megatron_zb.compare.Row``)."""

    name: str
    makespan: float
    bubble_rate: float
    frontier: bool

    @property
    def max_peak(self) -> float: ...


class Plotted(Protocol):
    """What is drawn of a comparison (a ``megatron_zb.compare.Comparison``); render stays below compare."""

    memory_limit: float | None

    @property
    def built(self) -> Sequence[Point]: ...

    @property
    def refused(self) -> Sequence[object]: ...

    def setting(self) -> str: ...


WIDTH, HEIGHT = 820, 520
LEFT, RIGHT, TOP, BOTTOM = 80, 190, 70, 64  # margins around the plot area, in pixels
LABEL_HEIGHT, CHAR_PX = 14, 7  # estimated text box size, for keeping labels apart
FRONTIER_COLOR, OTHER_COLOR, LIMIT_COLOR = "#e07020", "#5b8def", "#c03030"
_NS = ' xmlns="http://www.w3.org/2000/svg"'
_STYLE = (
    "text{font-family:sans-serif;font-size:12px;fill:#222}.title{font-size:14px;font-weight:bold}"
    ".tick{fill:#555}.xt{text-anchor:middle}.yt{text-anchor:end}.axis-title{text-anchor:middle}"
    ".axis{stroke:#555}.grid{stroke:#e4e4e4}.frontier-line{fill:none;stroke:" + FRONTIER_COLOR + ";stroke-width:1.5}"
    ".limit{stroke:" + LIMIT_COLOR + ";stroke-dasharray:6 4;stroke-width:1.5}.limit-label{fill:" + LIMIT_COLOR + "}"
    ".point{stroke:#fff;stroke-width:1}"
)


def _px(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _num(value: float) -> str:
    return f"{round(value, 9):g}"


def _pct(value: float) -> str:
    return f"{round(value * 100, 6):g}%"


def _ticks(high: float, most: int = 8) -> tuple[float, float]:
    """A 1/2/5 x 10^k step giving at most ``most`` ticks up to ``high``, and the axis end (a multiple of it)."""
    high = high if high > 0 else 1.0
    step = next(m * 10**e for e in range(-9, 12) for m in (1, 2, 5) if high / (m * 10**e) <= most)
    ticks = -(-round(high / step, 9) // 1)  # ceiling, forgiving float noise
    return step, max(ticks, 1) * step


class _Frame:
    """Data coordinates to pixels over the plot area; both axes start at 0."""

    def __init__(self, x_end: float, y_end: float) -> None:
        self.x_end, self.y_end = x_end, y_end
        self.width, self.height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(self, value: float) -> float:
        return LEFT + value / self.x_end * self.width

    def y(self, value: float) -> float:
        return TOP + self.height - value / self.y_end * self.height


def _axes(frame: _Frame, x_step: float, y_step: float) -> list[str]:
    bottom, right = TOP + frame.height, LEFT + frame.width
    out = []
    for i in range(round(frame.x_end / x_step) + 1):
        x = _px(frame.x(i * x_step))
        out.append(f'<line class="grid" x1="{x}" y1="{TOP}" x2="{x}" y2="{bottom}"/>')
        out.append(f'<text class="tick xt" x="{x}" y="{bottom + 16}">{_num(i * x_step)}</text>')
    for i in range(round(frame.y_end / y_step) + 1):
        y = _px(frame.y(i * y_step))
        out.append(f'<line class="grid" x1="{LEFT}" y1="{y}" x2="{right}" y2="{y}"/>')
        out.append(f'<text class="tick yt" x="{LEFT - 6}" y="{_px(frame.y(i * y_step) + 4)}">{_pct(i * y_step)}</text>')
    out.append(f'<path class="axis" d="M{LEFT} {TOP}V{bottom}H{right}" fill="none"/>')
    x_title = "max peak activation memory per rank (stage activations of one microbatch)"
    out.append(f'<text class="axis-title" x="{_px(LEFT + frame.width / 2)}" y="{bottom + 40}">{x_title}</text>')
    y_mid = _px(TOP + frame.height / 2)
    rotate = f"rotate(-90 22 {y_mid})"
    out.append(f'<text class="axis-title" x="22" y="{y_mid}" transform="{rotate}">stage-span bubble</text>')
    return out


def _frontier_line(frame: _Frame, frontier: list[Point]) -> list[str]:
    """Horizontal to the next point's memory, then down to its bubble; ends at the right edge."""
    if not frontier:
        return []
    points = sorted({(row.max_peak, row.bubble_rate) for row in frontier})
    d = f"M{_px(frame.x(points[0][0]))} {_px(frame.y(points[0][1]))}"
    for peak, bubble in points[1:]:
        d += f"H{_px(frame.x(peak))}V{_px(frame.y(bubble))}"
    d += f"H{_px(LEFT + frame.width)}"
    return [f'<path class="frontier-line" d="{d}"/>']


def _points(frame: _Frame, rows: Sequence[Point]) -> list[str]:
    out, labels = [], {}
    for row in rows:
        x, y = frame.x(row.max_peak), frame.y(row.bubble_rate)
        color = FRONTIER_COLOR if row.frontier else OTHER_COLOR
        tip = f"{row.name}: peak {_num(row.max_peak)}, bubble {row.bubble_rate:.2%}, makespan {_num(row.makespan)}"
        out.append(
            f'<circle class="point{" frontier" if row.frontier else ""}" cx="{_px(x)}" cy="{_px(y)}" r="5" '
            f'fill="{color}"><title>{escape(tip)}</title></circle>'
        )
        labels.setdefault((round(x), round(y)), []).append(row.name)  # equal points share one label
    placed: list[tuple[float, float, float]] = []  # (x0, x1, y) of labels already drawn
    for (x, y), group in sorted(labels.items(), key=lambda item: (item[0][1], item[0][0])):
        text = ", ".join(group)
        x0, x1 = x + 7, x + 7 + CHAR_PX * len(text)
        for shift in (0, -1, 1, -2, 2, -3, 3, -4, 4):
            ty = y - 7 + shift * LABEL_HEIGHT  # above right: clear of the frontier line leaving the point
            if all(x1 < a or x0 > b or abs(ty - py) >= LABEL_HEIGHT for a, b, py in placed):
                break
        placed.append((x0, x1, ty))
        out.append(f'<text class="label" x="{_px(x0)}" y="{_px(ty)}">{escape(text)}</text>')
    return out


def _legend(has_limit: bool) -> list[str]:
    x, y = LEFT + (WIDTH - LEFT - RIGHT) + 20, TOP + 6
    out = [
        f'<path d="M{x} {y - 4}h10v10h-10z" fill="{FRONTIER_COLOR}"/>',
        f'<text x="{x + 16}" y="{y + 5}">Pareto frontier</text>',
        f'<path d="M{x} {y + 14}h10v10h-10z" fill="{OTHER_COLOR}"/>',
        f'<text x="{x + 16}" y="{y + 23}">dominated</text>',
    ]
    if has_limit:
        out.append(f'<path class="limit" d="M{x} {y + 37}h12"/>')
        out.append(f'<text x="{x + 16}" y="{y + 41}">memory limit</text>')
    return out


def render_pareto_svg(comparison: Plotted) -> str:
    """A standalone SVG document: bubble vs peak memory for every built schedule of ``comparison``."""
    rows = comparison.built
    limit = comparison.memory_limit
    x_high = max([row.max_peak for row in rows] + ([limit] if limit is not None else []) + [0.0])
    x_step, x_end = _ticks(x_high * 1.08)  # room right of the last point or the limit
    y_step, y_end = _ticks(max([row.bubble_rate for row in rows] + [0.0]) * 1.08 or 0.05)
    frame = _Frame(x_end, y_end)
    setting = ", ".join(comparison.setting().split("  "))
    counts = f"{len(rows)} schedules built, {len(comparison.refused)} refused"
    body = [
        f'<svg{_NS} width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">',
        f"<style>{_STYLE}</style>",
        f'<text class="title" x="{LEFT}" y="24">stage-span bubble vs peak memory of each schedule</text>',
        f'<text x="{LEFT}" y="44">{escape(setting)}: {counts}</text>',
        *_axes(frame, x_step, y_step),
    ]
    if limit is not None:
        x = _px(frame.x(limit))
        body.append(f'<line class="limit" x1="{x}" y1="{TOP}" x2="{x}" y2="{TOP + frame.height}"/>')
        body.append(f'<text class="limit-label" x="{x}" y="{TOP - 6}">limit {_num(limit)}</text>')
    body += _frontier_line(frame, [row for row in rows if row.frontier])
    body += _points(frame, rows)
    body += _legend(limit is not None)
    body.append("</svg>")
    return "\n".join(body) + "\n"
