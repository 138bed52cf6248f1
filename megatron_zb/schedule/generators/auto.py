"""``auto``: the best schedule of every family, at every chunk count, that fits the memory limit.

Best means what sets the iteration time: the shortest makespan when an optimizer
synchronisation ends every iteration (then stage span, then peak memory); with optimizer
post-validation (``spec.post_validation``) iterations overlap and the stage span comes first.
On a full tie the schedule with fewer cross-rank messages goes first (linear, then V, then
interleaved; fewer chunks before more), then a named family (zb-v, zb-2p, ...) before v-auto and
zb-auto, which search over it.

Candidates: every family as built for the setting; a family that plans any chunk count
(registry option ``chunks``) is built at each count of ``chunk_counts`` unless ``--chunks``
names one; and PyTorch's ZB-V, DualPipeV and interleaved zero-bubble orders as they are (the
families use them as seeds too, but rank by stage span; here the makespan may prefer them).
With ``spec.layers`` a placement whose blocks do not split the layers is passed over. Families
that cannot run the setting (chunks, microbatch counts, the limit) are skipped; if none fits,
the error lists what each needs. Families that keep more than one copy of the weights
(BitPipe) are not among the candidates: their memory is not what the activation limit
measures; name them to run them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from ..ir import Schedule, ScheduleError
from ..placement import Placement, interleaved, v_shape
from ..registry import ScheduleSpec, build, get, names, register
from .result import Result, timed_schedule
from .search import Recipe, plan
from .torch_style import dualpipev_orders, interleaved_zb_orders, zbv_codes
from .v_blocks import as_passes

MOST_CHUNKS = 8  # chunk counts above it are not searched (planning time grows with the blocks)


def messages(placements: tuple[Placement, ...], microbatches: int) -> int:
    """Cross-rank transfers per iteration: an activation and a gradient per microbatch and rank boundary."""
    crossings = 0
    for placement in placements:
        crossings += sum(placement.rank_of(s) != placement.rank_of(s + 1) for s in range(placement.num_stages - 1))
    return 2 * crossings * microbatches


def chunk_counts(spec: ScheduleSpec) -> tuple[int, ...]:
    """Chunks per rank to plan the families that take any: the one asked for; else 1, 2 and 4, and with
    ``spec.layers`` those powers of two up to ``MOST_CHUNKS`` whose blocks split the layers."""
    if spec.chunks is not None:
        return (spec.chunks,)
    if spec.layers is None:
        return (1, 2, 4)
    return tuple(c for c in (1, 2, 4, 8) if c <= MOST_CHUNKS and spec.layers % (spec.pp * c) == 0)


def splits_layers(schedule: Schedule, spec: ScheduleSpec) -> bool:
    return spec.layers is None or all(spec.layers % placement.num_stages == 0 for placement in schedule.placements)


def _families(spec: ScheduleSpec, refusals: list[str]) -> Iterator[Schedule]:
    """Every family that keeps one copy of the weights, at each chunk count it takes (its refusal noted instead)."""
    for name in names():
        family = get(name)
        if family.composite or family.weight_copies > 1:
            continue
        counts = chunk_counts(spec) if "chunks" in family.options else (spec.chunks,)
        errors = []
        for chunks in counts:
            try:
                schedule = build(name, replace(spec, chunks=chunks, refine_seconds=0.0), suggest=False)
            except ScheduleError as error:
                errors.append(str(error).splitlines()[0])
                continue
            if not splits_layers(schedule, spec):
                errors.append(f"its {schedule.chunks} chunk(s) per rank do not split {spec.layers} layers")
                continue
            many = "chunks" in family.options and schedule.chunks > 1
            yield replace(schedule, name=f"{name}, {schedule.chunks} chunks" if many else name)
        if errors and len(errors) == len(counts):
            refusals.append(f"  {name}: {errors[0]}")


def torch_orders(spec: ScheduleSpec) -> Iterator[Schedule]:
    """PyTorch's ZB-V, DualPipeV and interleaved zero-bubble orders where they run the setting."""
    p, m = spec.pp, spec.microbatches
    if spec.chunks in (None, 2):
        yield Schedule(
            "PyTorch's ZBVZeroBubble order", (v_shape(p),), m, tuple(map(tuple, as_passes(p, m, zbv_codes(p, m))))
        )
        if m >= 2 * p:
            yield Schedule("PyTorch's DualPipeV order", (v_shape(p),), m, tuple(map(tuple, dualpipev_orders(p, m))))
    for chunks in (c for c in chunk_counts(spec) if c > 1):
        orders = tuple(map(tuple, interleaved_zb_orders(p, m, chunks)))
        label = f"PyTorch's InterleavedZeroBubble order, {chunks} chunks"
        yield Schedule(label, (interleaved(p, chunks),), m, orders)


def _candidates(spec: ScheduleSpec, refusals: list[str]) -> Iterator[Result]:
    costs = spec.cost_model()
    for schedule in _families(spec, refusals):
        yield timed_schedule(schedule, costs)
    for schedule in torch_orders(spec):
        if splits_layers(schedule, spec):
            yield timed_schedule(schedule, costs)


@register(
    "auto",
    "the best schedule of all families and chunk counts under --memory-limit (by makespan; stage span with "
    "--post-validation)",
    composite=True,
    options=("memory_limit", "chunks"),
)
def generate(spec: ScheduleSpec) -> Schedule:
    refusals: list[str] = []

    def rank(result: Result) -> tuple:
        span, makespan, peak = result.score()
        first = (span, makespan) if spec.post_validation else (makespan, span)
        # on a tie: fewer messages, then the named family over the searches that include it
        # (v-auto holds zb-v, zb-auto holds zb-2p), then PyTorch's orders (the families start from them)
        crossings = messages(result.encoding.placements, result.microbatches)
        family = result.label.split(",")[0]
        return (*first, peak, crossings, family.endswith("-auto"), family.startswith("PyTorch"))

    return plan(
        Recipe(
            "auto",
            spec,
            (),
            spec.memory_limit,
            seeds=(lambda: _candidates(spec, refusals),),
            rank=rank,
            title=lambda result: f"auto ({result.label})",
            refusal=lambda: "auto: no schedule can run this setting:\n" + "\n".join(refusals),
        )
    )
