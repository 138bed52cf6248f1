"""Pickers (``auto``, ``v-auto``) with overlapped F&B pairs: their candidates ranked as they run, paired.

Pairs change which schedule is fastest: an interleaved or V order pairs most of its passes, 1F1B
none (at pp 8, m 32, ``--cost-a2a 0.3``, interleaved-1f1b with 4 chunks goes from 101.25 to 85.8,
zb-2p with 4 chunks stays at 97.75). So a picker asked for pairs ranks its candidates by
``pairing.screened`` (their best whole set of pairs, timed once each: 0.3 s for auto's 28 there)
and places pairs on the ``FINALISTS`` first (``overlap_pairs``' greedy: 0.05 to 0.5 s each there), then
picks the best of those as placed. The pick is never worse than a finalist, nor than any candidate's
screened time (a finalist's pairs only shorten its screened one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..costs import CostModel
from ..ir import Schedule
from ..pairing import screened
from ..simulate import simulate

# candidates with the best screened times whose pairs are placed in full: at pp 4 and 8, m 2pp to 8pp, t_a2a 0.1
# to 0.5 (unit costs) the best of auto's candidates paired was always among the first two screened
FINALISTS = 2


@dataclass(frozen=True)
class Candidate:
    """A schedule without pairs, how it gets its pairs, and its place among equals (lower first)."""

    schedule: Schedule
    paired: Callable[[], Schedule]
    peak: float
    tie: tuple = ()
    label: str = ""  # what the picker names it by


def best_paired(candidates: Sequence[Candidate], costs: CostModel, key: str) -> tuple[Schedule, Candidate]:
    """The finalists' best paired schedule, by ``key`` ("makespan" or "stage_span" first), then peak, then tie.

    Candidates with the same orders are screened once (the first by tie keeps the place).
    """
    if not candidates:
        raise ValueError("best_paired needs at least one candidate")
    distinct: dict[tuple, Candidate] = {}
    for candidate in sorted(candidates, key=lambda c: c.tie):
        distinct.setdefault((candidate.schedule.placements, candidate.schedule.orders), candidate)
    ranked = sorted(
        distinct.values(), key=lambda c: (_rounded(screened(c.schedule, costs, key)), round(c.peak, 9), c.tie)
    )
    best: tuple[tuple, Schedule, Candidate] | None = None
    for candidate in ranked[:FINALISTS]:
        schedule = candidate.paired()
        timeline = simulate(schedule, costs)
        first = (timeline.stage_span, timeline.makespan)
        if key == "makespan":
            first = first[::-1]
        rank = (*_rounded(first), round(max(timeline.peak_memory, default=0.0), 9), candidate.tie)
        if best is None or rank < best[0]:
            best = (rank, schedule, candidate)
    return best[1], best[2]


def _rounded(times: tuple[float, float]) -> tuple[float, float]:
    return round(times[0], 9), round(times[1], 9)
