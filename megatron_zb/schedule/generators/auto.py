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

from dataclasses import replace

from ..ir import Schedule, ScheduleError
from ..registry import ScheduleSpec, build, get, names, register
from ..simulate import simulate
from .search import score


def messages(schedule: Schedule) -> int:
    """Cross-rank transfers per iteration: an activation and a gradient per microbatch and rank boundary."""
    crossings = 0
    for placement in schedule.placements:
        crossings += sum(placement.rank_of(s) != placement.rank_of(s + 1) for s in range(placement.num_stages - 1))
    return 2 * crossings * schedule.microbatches


@register(
    "auto",
    "the best schedule of all families under --memory-limit (by makespan; stage span with --post-validation)",
    composite=True,
)
def generate(spec: ScheduleSpec) -> Schedule:
    costs = spec.cost_model()
    best, best_score, refusals = None, None, []
    for name in names():
        if get(name).composite or get(name).weight_copies > 1:
            continue
        try:
            schedule = build(name, replace(spec, refine_seconds=0.0), suggest=False)
        except ScheduleError as error:
            refusals.append(f"  {name}: {str(error).splitlines()[0]}")
            continue
        candidate = score(simulate(schedule, costs))
        if not spec.post_validation:
            candidate = (candidate[1], candidate[0], candidate[2])
        # on a tie: fewer messages, then the named family over the searches that include it
        # (v-auto holds zb-v, zb-auto holds zb-2p)
        candidate = (*candidate, messages(schedule), name.endswith("-auto"))
        if best_score is None or candidate < best_score:
            best, best_score = schedule, candidate
    if best is None:
        raise ScheduleError("auto: no schedule can run this setting:\n" + "\n".join(refusals))
    if spec.refine_seconds > 0:
        from ..refine import refine

        best = refine(best, costs, spec.memory_limit, spec.refine_seconds)
    return replace(best, name=f"auto ({best.name})")
