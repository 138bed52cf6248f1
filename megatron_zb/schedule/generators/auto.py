"""``auto``: the best schedule of every family that fits the memory limit.

Best means what sets the iteration time: the shortest makespan when an optimizer
synchronisation ends every iteration (then stage span, then peak memory); with optimizer
post-validation (``spec.post_validation``) iterations overlap and the stage span comes first.
On a full tie the schedule with fewer cross-rank messages goes first (linear, then V, then
interleaved), then a named family (zb-v, zb-2p, ...) before v-auto and zb-auto, which search over it.
Families that cannot run the setting
(chunks, microbatch counts, the limit) are skipped; if none fits, the error lists what each
needs. Families that keep more than one copy of the weights (BitPipe) are not among the
candidates: their memory is not what the activation limit measures; name them to run them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from ..ir import Schedule, ScheduleError
from ..placement import Placement
from ..registry import ScheduleSpec, build, get, names, register
from .result import Result, timed_schedule
from .search import Recipe, plan


def messages(placements: tuple[Placement, ...], microbatches: int) -> int:
    """Cross-rank transfers per iteration: an activation and a gradient per microbatch and rank boundary."""
    crossings = 0
    for placement in placements:
        crossings += sum(placement.rank_of(s) != placement.rank_of(s + 1) for s in range(placement.num_stages - 1))
    return 2 * crossings * microbatches


def _families(spec: ScheduleSpec, refusals: list[str]) -> Iterator[Result]:
    """Every family that keeps one copy of the weights, as built at ``spec`` (its refusal noted instead)."""
    for name in names():
        if get(name).composite or get(name).weight_copies > 1:
            continue
        try:
            schedule = build(name, replace(spec, refine_seconds=0.0), suggest=False)
        except ScheduleError as error:
            refusals.append(f"  {name}: {str(error).splitlines()[0]}")
            continue
        yield timed_schedule(schedule, spec.cost_model())


@register(
    "auto",
    "the best schedule of all families under --memory-limit (by makespan; stage span with --post-validation)",
    composite=True,
    options=("memory_limit",),
)
def generate(spec: ScheduleSpec) -> Schedule:
    refusals: list[str] = []

    def rank(result: Result) -> tuple:
        span, makespan, peak = result.score()
        first = (span, makespan) if spec.post_validation else (makespan, span)
        # on a tie: fewer messages, then the named family over the searches that include it
        # (v-auto holds zb-v, zb-auto holds zb-2p)
        crossings = messages(result.encoding.placements, result.microbatches)
        return (*first, peak, crossings, result.label.endswith("-auto"))

    return plan(
        Recipe(
            "auto",
            spec,
            (),
            spec.memory_limit,
            seeds=(lambda: _families(spec, refusals),),
            rank=rank,
            title=lambda result: f"auto ({result.label})",
            refusal=lambda: "auto: no schedule can run this setting:\n" + "\n".join(refusals),
        )
    )
