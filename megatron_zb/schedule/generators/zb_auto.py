"""Automatic zero-bubble schedules under a memory limit: zb-auto, and its presets zb-1p, zb-2p.

Candidates: the round heuristic of the ZB paper (zb_rounds.py, one chunk per rank) and the
list scheduler (greedy.py) with every switch setting; the handmade orders join as seeds when
they fit, so the result is never worse than them. With one chunk per rank the placement is
Megatron's linear one and the seeds are 1f1b, zb-h1 and zb-h2; with ``--chunks v`` (v >= 2)
it is Megatron's interleaved (looping) placement, seeded with interleaved-1f1b, its B/W split
(Ws right after their B, or deferred to the cool-down) and the PyTorch-style interleaved zero
bubble order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache

from ..ir import Pass, Schedule, ScheduleError
from ..placement import interleaved, linear
from ..registry import ScheduleSpec, register
from . import interleaved as interleaved_1f1b
from . import one_f_one_b, zb_h1, zb_h2
from .common import linear_schedule
from .moves import defer, split_backward
from .result import Result
from .search import check_ceiling, large, plan, searched
from .torch_style import interleaved_zb_passes
from .zb_rounds import ROUND_SWITCHES, round_orders

HANDMADE = {"1f1b": one_f_one_b.rank_order, "zb-h1": zb_h1.rank_order, "zb-h2": zb_h2.rank_order}


def zb_auto(name: str, spec: ScheduleSpec, limit: float | None) -> Schedule:
    """The search under ``limit``, planned once per setting and limit: zb-auto at 1f1b's memory is zb-1p
    (``auto`` builds both), so the second takes the first's orders under its own name."""
    search = _search if spec.refine_seconds > 0 else _zb_auto  # the solver's refinement is timed: never kept
    try:
        return replace(search(_ANY, replace(spec, memory_limit=None), limit), name=name)
    except ScheduleError as error:
        error.args = tuple(str(arg).replace(_ANY, name) for arg in error.args)  # the caller's name in the message
        raise


_ANY = "<zb-auto search>"  # the name the shared search plans under


@lru_cache(maxsize=8)
def _zb_auto(name: str, spec: ScheduleSpec, limit: float | None) -> Schedule:
    return _search(name, spec, limit)


def _search(name: str, spec: ScheduleSpec, limit: float | None) -> Schedule:
    if spec.chunks is not None and spec.chunks > 1:
        placement = interleaved(spec.pp, spec.chunks)
        check_ceiling(name, spec, (placement,))  # before the seeds are made
        return plan(searched(name, spec, placement, limit, interleaved_seeds(name, spec)))
    linear_schedule(name, spec, lambda r, p, m: [])  # refuses --chunks < 1
    check_ceiling(name, spec, (linear(spec.pp),))
    seeds: list = [split(linear_schedule(name, spec, order)) for order in HANDMADE.values()]
    costs = spec.cost_model()
    planners = [(lambda m, s=setting: round_orders(costs, m, limit, s)) for setting in ROUND_SWITCHES]
    if large(spec, linear(spec.pp)):  # a sample ranks them on it alone; planned for all they are cheap and
        seeds += _planned(planners, spec.microbatches)  # settings that tie there may end apart (the makespan)
        planners = []
    return plan(searched(name, spec, linear(spec.pp), limit, seeds, planners, lean=True))


def _planned(planners: list[Callable[[int], Result]], m: int) -> list[Result]:
    """Each planner's plan of all ``m`` microbatches, those that plan."""
    found = []
    for planner in planners:
        try:
            found.append(planner(m))
        except ScheduleError:
            continue
    return found


def split(schedule: Schedule) -> Schedule:
    return replace(schedule, orders=split_backward(schedule.orders))


def interleaved_seeds(name: str, spec: ScheduleSpec) -> list[Schedule]:
    """interleaved-1f1b with each BW split (W at once, or every W after the last B), and interleaved zero bubble."""
    p, m, v = spec.pp, spec.microbatches, spec.chunks
    placement = interleaved(p, v)
    return [
        Schedule(name, (placement,), m, orders) for orders in (interleaved_zb_passes(p, m, v), *_split_1f1b(p, m, v))
    ]


@lru_cache(maxsize=8)
def _split_1f1b(p: int, m: int, v: int) -> tuple[tuple[tuple[Pass, ...], ...], ...]:
    """interleaved-1f1b's orders with each BW split, W at once and W deferred (none where it cannot run); made
    once per setting, as zb-1p, zb-2p and zb-auto all seed from them (one orders object is timed once)."""
    try:
        plain = interleaved_1f1b.generate(ScheduleSpec(p, m, chunks=v))
    except ScheduleError:
        return ()
    at_once = split_backward(plain.orders)
    return at_once, defer(at_once)


def preset_limit(spec: ScheduleSpec, factor: int) -> float:
    """``factor * pp`` microbatches of the heaviest stage's activations (ZB-1p: 1F1B's memory)."""
    return factor * spec.pp * max(spec.cost_model().mem_f)


@register(
    "zb-auto",
    "automatic zero bubble: best schedule under --memory-limit (unlimited if not given); --chunks v",
    options=("memory_limit", "chunks"),
)
def generate(spec: ScheduleSpec) -> Schedule:
    return zb_auto("zb-auto", spec, spec.memory_limit)


def _preset(factor: int) -> Callable[[ScheduleSpec], Schedule]:
    return lambda spec: zb_auto(f"zb-{factor}p", spec, preset_limit(spec, factor))


for _factor, _summary in (
    (1, "automatic zero bubble at 1f1b's memory (limit pp microbatches); between zb-h1 and zb-h2"),
    (2, "automatic zero bubble at twice 1f1b's memory (limit 2pp); about zero bubble for m >= 3pp"),
):
    register(f"zb-{_factor}p", _summary, options=("chunks",))(_preset(_factor))
