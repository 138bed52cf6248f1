"""Terminal timeline: one row of characters per rank, time running left to right.

The scale is chosen so that every pass can show its full label (the shortest pass decides,
usually an F or a W), and only shrinks when a ``width`` is given. A column belongs to the pass
covering the column's midpoint, so rounding never makes two passes overlap. A rank with
data-parallel collectives gets a second row for them (their own stream); releases take no
time and are not drawn. An all-to-all split out of a pass holds the compute stream and is drawn
in the rank's row, before the rest of its pass. An overlapped pair is one cell, both labels joined
by ``&`` (``F6&b0``).
"""

from __future__ import annotations

import logging
import math

from ..schedule.actions import Stream, spec
from ..schedule.simulate import PassTime, Timeline

logger = logging.getLogger(__name__)

IDLE = "."
PAD = "-"  # the columns of a pass after its label
MAX_COLUMNS = 2000  # without a width, a very short pass could otherwise ask for millions of columns
LEGEND = (
    "legend: F3 forward of microbatch 3 | B3 backward (input grad) | W3 backward (weight grad) | BW3 fused B+W",
    "        lowercase: odd model chunk | - pass continues | . idle | narrow passes: F B W, X = BW",
)

COLLECTIVES_LEGEND = "        collectives row: U2 gathers stage 2's weights | R2 reduces its gradients"
ALL_TO_ALL_LEGEND = (
    "        a3 expert-parallel all-to-all (dispatch + combine) of F3 | A3 of B3 (or BW3): each is part of the pass "
    "after it"
)
PAIR_LEGEND = "        F6&b0 an overlapped pair: one step, each one's all-to-all behind the other's compute"
_RESET = "\x1b[0m"
_NICE_STEPS = (1, 2, 5)


def _label(t: PassTime) -> str:
    p = t.pass_
    if p.kind.per_microbatch and not p.kind.is_compute:
        return f"{spec(p.kind).short}{p.microbatch}"
    if not p.kind.is_compute:
        return f"{spec(p.kind).short}{p.stage}"
    return f"{p.kind.value}{p.microbatch}"


def _cell_text(t: PassTime, columns: int, partner: PassTime | None = None) -> str:
    """The label that fits ``columns``, padded; odd chunks in lowercase; a pair's two labels joined."""
    if partner is not None:
        texts = [_cell_text(x, len(_label(x))) for x in (t, partner)]
        shorts = [_cell_text(x, len(x.pass_.kind.value)) for x in (t, partner)]
        text = next((c for c in ("&".join(texts), "&".join(shorts), "&") if len(c) <= columns), "")
        return (text + PAD * columns)[:columns]
    kind = t.pass_.kind
    text = next((c for c in (_label(t), kind.value, spec(kind).short) if len(c) <= columns), "")
    text = (text + PAD * columns)[:columns]
    return text.lower() if t.chunk % 2 and kind.is_compute else text


def _scale(timeline: Timeline, span: float, chart_width: int | None) -> float:
    """Columns per time unit: the widest label (a pair's two) over its pass's duration, capped by the width."""
    partner = {p: q for pair in timeline.schedule.overlapped for p, q in (pair, pair[::-1])}
    lengths = {t.pass_: len(_label(t)) for rank in timeline.ranks for t in rank}
    needs = [
        (lengths[t.pass_] + (1 + lengths[partner[t.pass_]] if t.pass_ in partner else 0)) / (t.end - t.start)
        for rank in timeline.ranks
        for t in rank
        if t.end > t.start
    ]
    scale = max(needs, default=1.0)
    limit = chart_width if chart_width is not None else MAX_COLUMNS
    if span > 0 and not math.isfinite(limit / span):
        return 1.0  # a span too short for floats to scale (subnormal costs): one column
    if span > 0 and span * scale > limit:
        logger.debug("text timeline scaled down from %.3g to %.3g columns per time unit", scale, limit / span)
        scale = limit / span
    return scale


def _column(time: float, scale: float) -> int:
    """First column whose midpoint is at or after ``time`` (time measured from the origin)."""
    return math.ceil(round(time * scale - 0.5, 9))


def _row(
    passes: tuple[PassTime, ...], origin: float, scale: float, columns: int, color: bool, partner: dict | None = None
) -> str:
    """One lane; ``partner`` maps the first pass of each overlapped pair to its second's time (drawn in one cell)."""
    partner = partner or {}
    seconds = {t.pass_ for t in partner.values()}
    cells = [IDLE] * columns
    for t in passes:
        if t.pass_ in seconds:
            continue
        first, last = _column(t.start - origin, scale), min(_column(t.end - origin, scale), columns)
        if last <= first:
            continue
        text = _cell_text(t, last - first, partner.get(t.pass_))
        if color:
            cells[first : last - 1] = text[:-1]
            cells[last - 1] = text[-1] + _RESET
            cells[first] = spec(t.pass_.kind).ansi + cells[first]
        else:
            cells[first:last] = text
    return "".join(cells)


def _axis(prefix_width: int, origin: float, span: float, scale: float, columns: int) -> str:
    """Tick labels at round times, at least six columns apart."""
    low = max(-6, math.floor(math.log10(6 / scale)) - 1) if 0 < scale < math.inf else -6  # huge spans too
    step = next(mult * 10**exp for exp in range(low, low + 4) for mult in _NICE_STEPS if mult * 10**exp * scale >= 6)
    line = "time".ljust(prefix_width)
    for tick in range(int(span / step + 1e-9) + 1):
        at = prefix_width + _column(tick * step, scale)
        if at > prefix_width + columns or (tick and at <= len(line)):
            continue
        line = line.ljust(at) + f"{origin + tick * step:g}"
    return line


def _num(value: float) -> str:
    return f"{value:.6g}"


def _summary(timeline: Timeline, scale: float) -> list[str]:
    schedule = timeline.schedule
    peaks = "  ".join(f"rank {r}: {_num(m)}" for r, m in enumerate(timeline.peak_memory))
    return [
        f"schedule     {schedule.name}  pp={schedule.pp}  microbatches={schedule.microbatches}  "
        f"chunks={schedule.chunks}",
        f"makespan     {_num(timeline.makespan)}  stage span {_num(timeline.stage_span)}",
        f"bubble rate  {timeline.bubble_rate:.2%} (stage span)  {timeline.bubble_rate_makespan:.2%} (makespan)",
        f"peak memory  {peaks}",
        f"scale        1 column = {_num(1 / scale)} time units",
        *([f"pairs        {len(schedule.overlapped)} overlapped F&B pairs"] if schedule.overlapped else []),
    ]


def render_text(timeline: Timeline, width: int | None = None, color: bool = False) -> str:
    """The timeline as text; ``width`` caps the whole chart line (rank label and bars included)."""
    starts = [t.start for rank in timeline.ranks for t in rank]
    origin = min(starts, default=0.0)
    span = timeline.makespan
    digits = len(str(max(len(timeline.ranks) - 1, 0)))
    prefixes = [f"rank {r:>{digits}} |" for r in range(len(timeline.ranks))]
    prefix_width = len(prefixes[0]) if prefixes else 0
    chart_width = None if width is None else max(width - prefix_width - 1, 1)
    scale = _scale(timeline, span, chart_width)
    columns = math.ceil(round(span * scale, 9))
    lines = []
    partner_of = {p: q for pair in timeline.schedule.overlapped for p, q in (pair, pair[::-1])}
    for prefix, passes in zip(prefixes, timeline.ranks, strict=True):
        compute = tuple(t for t in passes if spec(t.pass_.kind).blocks_compute)
        collectives = tuple(t for t in passes if spec(t.pass_.kind).stream is Stream.COLLECTIVE)
        partner = {t.pass_: u for t, u in zip(compute, compute[1:], strict=False) if partner_of.get(t.pass_) == u.pass_}
        lines.append(prefix + _row(compute, origin, scale, columns, color, partner) + "|")
        if collectives:
            lane = "dp |".rjust(prefix_width)
            lines.append(lane + _row(collectives, origin, scale, columns, color) + "|")
    lines.append(_axis(prefix_width, origin, span, scale, columns))
    lines.extend(LEGEND)
    streams = {spec(t.pass_.kind).stream for rank in timeline.ranks for t in rank}
    if streams & {Stream.COLLECTIVE, Stream.HOST}:
        lines.append(COLLECTIVES_LEGEND)
    if Stream.EXPERT in streams:
        lines.append(ALL_TO_ALL_LEGEND)
    if timeline.schedule.overlapped:
        lines.append(PAIR_LEGEND)
    lines.append("")
    lines.extend(_summary(timeline, scale))
    return "\n".join(lines) + "\n"
