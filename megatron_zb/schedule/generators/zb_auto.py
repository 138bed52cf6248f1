"""Automatic zero-bubble schedules under a memory limit: zb-auto, and its presets zb-1p, zb-2p.

The list scheduler (greedy.py) runs with every switch setting; the handmade orders join as
candidates when they fit, so the result is never worse than them. With one chunk per rank the
placement is Megatron's linear one and the handmade orders are 1f1b, zb-h1 and zb-h2; with
``--chunks v`` (v >= 2) it is Megatron's interleaved (looping) placement, seeded with
interleaved-1f1b and its B/W split (Ws right after their B, or deferred to the cool-down).
"""

from __future__ import annotations

from dataclasses import replace

from ..ir import Pass, PassKind, Schedule, ScheduleError
from ..placement import interleaved, linear
from ..registry import ScheduleSpec, register
from . import interleaved as interleaved_1f1b
from . import one_f_one_b, zb_h1, zb_h2
from .common import linear_schedule
from .search import searched

HANDMADE = {"1f1b": one_f_one_b.rank_order, "zb-h1": zb_h1.rank_order, "zb-h2": zb_h2.rank_order}


def zb_auto(name: str, spec: ScheduleSpec, limit: float | None) -> Schedule:
    if spec.chunks is not None and spec.chunks > 1:
        placement = interleaved(spec.pp, spec.chunks)
        return searched(name, spec, placement, limit, interleaved_seeds(name, spec))
    linear_schedule(name, spec, lambda r, p, m: [])  # refuses --chunks < 1
    seeds = (linear_schedule(seed, spec, order) for seed, order in HANDMADE.items())
    return searched(name, spec, linear(spec.pp), limit, seeds)


def interleaved_seeds(name: str, spec: ScheduleSpec) -> list[Schedule]:
    """interleaved-1f1b with each BW split into B then W at once, and with every W moved after the last B."""
    try:
        fused = interleaved_1f1b.generate(replace(spec, memory_limit=None))
    except ScheduleError:
        return []
    at_once, deferred = [], []
    for order in fused.orders:
        now: list[Pass] = []
        for p in order:
            now += (
                [Pass(PassKind.B, p.stage, p.microbatch), Pass(PassKind.W, p.stage, p.microbatch)]
                if (p.kind is PassKind.BW)
                else [p]
            )
        at_once.append(tuple(now))
        deferred.append(tuple([p for p in now if p.kind is not PassKind.W] + [p for p in now if p.kind is PassKind.W]))
    return [Schedule(name, fused.placements, fused.microbatches, tuple(orders)) for orders in (at_once, deferred)]


def preset_limit(spec: ScheduleSpec, factor: int) -> float:
    """``factor * pp`` microbatches of the heaviest stage's activations (ZB-1p: 1F1B's memory)."""
    return factor * spec.pp * max(spec.cost_model().mem_f)


@register("zb-auto", "automatic zero bubble: best schedule under --memory-limit (unlimited if not given); --chunks v")
def generate(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-auto", spec, spec.memory_limit)


@register("zb-1p", "automatic zero bubble at 1f1b's memory (limit pp microbatches); between zb-h1 and zb-h2")
def generate_1p(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-1p", spec, preset_limit(spec, 1))


@register("zb-2p", "automatic zero bubble at twice 1f1b's memory (limit 2pp); about zero bubble for m >= 3pp")
def generate_2p(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-2p", spec, preset_limit(spec, 2))
