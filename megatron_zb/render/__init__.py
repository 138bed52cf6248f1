"""Renderers of a simulated Timeline: terminal text, SVG, HTML and Chrome/Perfetto trace. Pure stdlib."""

from __future__ import annotations

from collections.abc import Callable

from ..schedule.simulate import Timeline
from .chrome_trace import render_chrome_trace, render_chrome_trace_json
from .svg import render_html, render_svg
from .text import render_text

FORMATS: dict[str, Callable[[Timeline], str]] = {
    "text": render_text,
    "svg": render_svg,
    "html": render_html,
    "chrome-trace": render_chrome_trace_json,
}

__all__ = [
    "FORMATS",
    "render_chrome_trace",
    "render_chrome_trace_json",
    "render_html",
    "render_svg",
    "render_text",
]
