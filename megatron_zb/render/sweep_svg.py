"""SVG line chart of a sweep: efficiency against microbatches per iteration, one line per schedule.

Each schedule is one ``<polyline class="series ...">`` with a ``<circle>`` per point (titles
on hover); the x axis is logarithmic in the microbatch count. Pure stdlib, no outside resources.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 820, 520
LEFT, RIGHT, TOP, BOTTOM = 70, 200, 60, 60
PALETTE = ("#5b8def", "#f2a541", "#5cb85c", "#b07cd8", "#d9534f", "#17a2b8", "#8d6e63", "#e83e8c", "#6c757d")
_NS = ' xmlns="http://www.w3.org/2000/svg"'


def render_sweep_svg(sweep) -> str:
    """``sweep``: a ``megatron_zb.sweep.Sweep``."""
    series = sweep.series()
    ms = sorted(sweep.microbatches)
    low, high = math.log2(ms[0]), math.log2(ms[-1])
    floor = min((p.efficiency for points in series.values() for p in points), default=0.0)
    floor = max(0.0, math.floor(floor * 10) / 10)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(m: int) -> float:
        return LEFT + (plot_w * (math.log2(m) - low) / (high - low) if high > low else plot_w / 2)

    def y(efficiency: float) -> float:
        return TOP + plot_h * (1.0 - (efficiency - floor) / (1.0 - floor if floor < 1 else 1.0))

    out = [
        f'<svg{_NS} width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">',
        "<style>text{font-family:sans-serif;font-size:12px;fill:#222}.title{font-size:14px;font-weight:bold}"
        ".axis{stroke:#555}.grid{stroke:#e4e4e4}.series{fill:none;stroke-width:2}.tick{fill:#555}</style>",
        f'<text class="title" x="{LEFT}" y="24">efficiency vs microbatches per iteration: {escape(sweep.label)}</text>',
        f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}"/>',
        f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}"/>',
    ]
    for m in ms:
        out.append(f'<text class="tick" x="{x(m):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{m}</text>')
    for step in range(11):
        level = floor + (1.0 - floor) * step / 10
        out.append(f'<line class="grid" x1="{LEFT}" y1="{y(level):.1f}" x2="{LEFT + plot_w}" y2="{y(level):.1f}"/>')
        out.append(f'<text class="tick" x="{LEFT - 6}" y="{y(level) + 4:.1f}" text-anchor="end">{level:.0%}</text>')
    out.append(
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 16}" text-anchor="middle">microbatches per iteration</text>'
    )
    ranked = sorted(series.items(), key=lambda item: -item[1][-1].efficiency)
    for index, (name, points) in enumerate(ranked):
        color = PALETTE[index % len(PALETTE)]
        dash = ' stroke-dasharray="6 3"' if index >= len(PALETTE) else ""  # colors repeat: dashed the second time
        coords = " ".join(f"{x(p.microbatches):.1f},{y(p.efficiency):.1f}" for p in points)
        out.append(f'<polyline class="series {escape(name)}" stroke="{color}"{dash} points="{coords}"/>')
        for p in points:
            tip = f"{name} m={p.microbatches}: {p.efficiency:.2%}, makespan {p.makespan:g}, peak {p.peak_memory:g}"
            out.append(
                f'<circle cx="{x(p.microbatches):.1f}" cy="{y(p.efficiency):.1f}" r="3" fill="{color}">'
                f"<title>{escape(tip)}</title></circle>"
            )
        ly = TOP + 16 * index
        out.append(
            f'<line x1="{WIDTH - RIGHT + 16}" y1="{ly}" x2="{WIDTH - RIGHT + 36}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 42}" y="{ly + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
