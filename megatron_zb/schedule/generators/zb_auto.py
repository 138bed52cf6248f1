"""Automatic zero-bubble schedules under a memory limit: zb-auto, and its presets zb-1p, zb-2p.

The list scheduler (greedy.py) runs with every switch setting; the handmade 1f1b, zb-h1 and
zb-h2 orders join as candidates when they fit, so the result is never worse than them.
"""

from __future__ import annotations

from ..ir import Schedule
from ..placement import linear
from ..registry import ScheduleSpec, register
from . import one_f_one_b, zb_h1, zb_h2
from .common import linear_schedule
from .search import searched

HANDMADE = {"1f1b": one_f_one_b.rank_order, "zb-h1": zb_h1.rank_order, "zb-h2": zb_h2.rank_order}


def zb_auto(name: str, spec: ScheduleSpec, limit: float | None) -> Schedule:
    linear_schedule(name, spec, lambda r, p, m: [])  # refuses --chunks > 1
    seeds = (linear_schedule(seed, spec, order) for seed, order in HANDMADE.items())
    return searched(name, spec, linear(spec.pp), limit, seeds)


def preset_limit(spec: ScheduleSpec, factor: int) -> float:
    """``factor * pp`` microbatches of the heaviest stage's activations (ZB-1p: 1F1B's memory)."""
    return factor * spec.pp * max(spec.cost_model().mem_f)


@register("zb-auto", "automatic zero bubble: best schedule under --memory-limit (unlimited if not given)")
def generate(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-auto", spec, spec.memory_limit)


@register("zb-1p", "automatic zero bubble at 1f1b's memory (limit pp microbatches); between zb-h1 and zb-h2")
def generate_1p(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-1p", spec, preset_limit(spec, 1))


@register("zb-2p", "automatic zero bubble at twice 1f1b's memory (limit 2pp); about zero bubble for m >= 3pp")
def generate_2p(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-2p", spec, preset_limit(spec, 2))
