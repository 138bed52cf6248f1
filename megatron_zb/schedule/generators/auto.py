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

With overlapped F&B pairs (``spec.overlap_f_b`` and all-to-all time in the costs) the candidates
are ranked as they run paired (finalists.py): the best screened few get their pairs (a family's as
its build places them) and the best of those is the pick. A family is then refused unplanned only
when its placement cannot get under the best time so far even with every all-to-all hidden.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from ..ir import Schedule, ScheduleError
from ..pairing import overlap_pairs
from ..placement import Placement, interleaved, v_shape
from ..registry import ScheduleSpec, build, get, limit_refusal, names, pairs_key, register
from ..timing import EPS
from .finalists import Candidate, best_paired
from .result import Result, peak, timed_schedule
from .search import Ceiling, Recipe, ceiling, plan
from .torch_style import dualpipev_orders, interleaved_zb_passes, zbv_codes
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


def _builds(spec: ScheduleSpec) -> list[tuple[str, int | None]]:
    """(family, chunks) of every family that keeps one copy of the weights, at each chunk count it takes;
    most chunks first (they tend to win, and a good makespan early lets ``ceiling`` refuse the rest)."""
    builds = []
    for name in names():
        family = get(name)
        if family.composite or family.weight_copies > 1:
            continue
        counts = chunk_counts(spec) if "chunks" in family.options else (spec.chunks,)
        builds += [(name, chunks) for chunks in counts]
    return sorted(builds, key=lambda build: -(build[1] or 0))


def _family(spec: ScheduleSpec, name: str, chunks: int | None, bound: Ceiling) -> Schedule | str:
    """The family built at ``chunks`` (named for it), or why not; ``bound``: refused unplanned when out of reach."""
    try:
        with ceiling(bound):  # unchecked: only the pick is validated (when ``auto`` is built)
            schedule = build(name, replace(spec, chunks=chunks, refine_seconds=0.0), suggest=False, checked=False)
    except ScheduleError as error:
        return str(error).splitlines()[0]
    if not splits_layers(schedule, spec):
        return f"its {schedule.chunks} chunk(s) per rank do not split {spec.layers} layers"
    many = "chunks" in get(name).options and schedule.chunks > 1
    return replace(schedule, name=f"{name}, {schedule.chunks} chunks" if many else name)


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
        orders = interleaved_zb_passes(p, m, chunks)
        label = f"PyTorch's InterleavedZeroBubble order, {chunks} chunks"
        yield Schedule(label, (interleaved(p, chunks),), m, orders)


class _Search:
    """The candidates in the order that sets a ceiling early, each ranked as if in the listed order
    (families by name and chunk count, then PyTorch's orders): ``position`` breaks full ties, so the
    pick is the same whatever order they are built in. A family whose placement cannot beat the best
    fitting candidate so far on the first key (``time_bound``) is not planned; it could not be picked."""

    def __init__(self, spec: ScheduleSpec):
        self.spec, self.refusals = spec, []
        self.position: dict[str, int] = {}
        self.first: float | None = None  # the best fitting candidate's first key so far
        self.pairs = pairs_key(spec)
        self.slack = hidden_at_most(spec) if self.pairs else 0.0  # pairs can beat the bound by as much
        self.fitting: dict[str, tuple[Result, Schedule, tuple[str, int | None] | None]] = {}  # label -> made by

    def candidates(self) -> Iterator[Result]:
        spec, costs = replace(self.spec, overlap_f_b=False), self.spec.cost_model()  # pairs: for the finalists
        listed = sorted(_builds(spec), key=lambda build: (build[0], build[1] or 0))
        for order, schedule in enumerate(torch_orders(spec)):
            self.position[schedule.name] = len(listed) + order
            if splits_layers(schedule, spec):
                yield self._seen(timed_schedule(schedule, costs), schedule)
        errors: dict[tuple[str, int | None], str] = {}
        for name, chunks in _builds(spec):
            first = math.inf if self.first is None else self.first + self.slack
            bound = Ceiling(first, self.spec.post_validation, self.spec.memory_limit)
            made = _family(spec, name, chunks, bound)
            if isinstance(made, str):
                errors[name, chunks] = made
                continue
            result = timed_schedule(made, costs, spec.memory_limit)  # not timed over the limit
            too_big = limit_refusal(name, peak(made, costs), spec) if result is None else None
            if too_big is not None:
                errors[name, chunks] = too_big
                continue
            self.position[made.name] = listed.index((name, chunks))
            yield self._seen(result, made, (name, chunks))
        for name in dict.fromkeys(name for name, _ in listed):
            mine = [errors.get(build) for build in listed if build[0] == name]
            if all(mine):
                self.refusals.append(f"  {name}: {mine[0]}")

    def _seen(
        self, result: Result | None, schedule: Schedule, family: tuple[str, int | None] | None = None
    ) -> Result | None:
        limit = self.spec.memory_limit
        if result is not None and (limit is None or result.peak <= limit + EPS):
            key = result.stage_span if self.spec.post_validation else result.makespan
            self.first = key if self.first is None else min(self.first, key)
            if self.pairs:
                self.fitting[result.label] = (result, schedule, family)
        return result

    def paired_pick(self, picked: Schedule) -> Schedule:
        """The best fitting candidate as it runs paired (finalists.py), named as ``auto`` names its pick.

        A family's pairs are its build's (``v-auto`` places its own); ``picked`` (the pick without pairs) is
        a candidate too when the solver refined it."""
        costs = self.spec.cost_model()
        candidates = [self._candidate(*made) for made in self.fitting.values()]
        if self.spec.refine_seconds > 0:
            label = picked.name.removeprefix("auto (").removesuffix(")")

            def refined() -> Schedule:
                return overlap_pairs(picked, costs, self.pairs)

            candidates.append(Candidate(picked, refined, peak(picked, costs), (), label))  # first among equals
        paired, chosen = best_paired(candidates, costs, self.pairs)
        return replace(paired, name=f"auto ({chosen.label})")

    def _candidate(self, result: Result, schedule: Schedule, family: tuple[str, int | None] | None) -> Candidate:
        costs = self.spec.cost_model()
        if family is None:  # PyTorch's orders

            def paired() -> Schedule:
                return overlap_pairs(schedule, costs, self.pairs)
        else:
            spec = replace(self.spec, chunks=family[1], refine_seconds=0.0)

            def paired() -> Schedule:
                return build(family[0], spec, suggest=False, checked=False)

        return Candidate(schedule, paired, result.peak, self.rank(result)[3:], result.label)

    def rank(self, result: Result) -> tuple:
        span, makespan, peak = result.score()
        first = (span, makespan) if self.spec.post_validation else (makespan, span)
        # on a tie: fewer messages, then the named family over the searches that include it
        # (v-auto holds zb-v, zb-auto holds zb-2p), then PyTorch's orders (the families start from them)
        crossings = messages(result.encoding.placements, result.microbatches)
        family = result.label.split(",")[0]
        tie = (crossings, family.endswith("-auto"), family.startswith("PyTorch"), self.position[result.label])
        return (*first, peak, *tie)


def hidden_at_most(spec: ScheduleSpec) -> float:
    """How much overlapped pairs can shorten ``search.time_bound`` on any placement: a rank's all-to-all time
    (at most the largest stage's per microbatch, m times) and the forward all-to-alls on the way to it."""
    costs = spec.cost_model()
    per_stage = (f + b for f, b in zip(costs.t_a2a, costs.t_a2a_b, strict=True))
    return spec.microbatches * max(per_stage, default=0.0) + sum(costs.t_a2a)


@register(
    "auto",
    "the best schedule of all families and chunk counts under --memory-limit (by makespan; stage span with "
    "--post-validation)",
    composite=True,
    options=("memory_limit", "chunks", "overlap_f_b"),
)
def generate(spec: ScheduleSpec) -> Schedule:
    search = _Search(spec)
    picked = plan(
        Recipe(
            "auto",
            spec,
            (),
            spec.memory_limit,
            seeds=(search.candidates,),
            rank=search.rank,
            title=lambda result: f"auto ({result.label})",
            refusal=lambda: "auto: no schedule can run this setting:\n" + "\n".join(search.refusals),
        )
    )
    return search.paired_pick(picked) if search.pairs else picked
