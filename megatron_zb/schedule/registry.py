"""Registry of schedule generators: a name, a one-line summary and ``generate(spec)``.

Generators emit compute passes only; ``build`` validates what they return, so no schedule
reaches the simulator or the runtime unchecked. A plan is a pure function of the generator and
the spec fields it reads, and the same one is asked for again and again (``auto`` builds every
family, a memory refusal builds them all to suggest one, the CLI's compare, re-plans): the last
``PLANS_KEPT`` validated plans are kept (not those refined by the solver, which has a time limit).
``ScheduleSpec.overlap_f_b`` asks for overlapped F&B pairs (``pairing.overlap_pairs``) on whatever the
generator returned, where the costs have all-to-all time; only pickers that rank their candidates paired
(option "overlap_f_b": ``auto``, ``v-auto``) see it, and place the pairs themselves.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache, wraps

from .costs import CostModel
from .ir import Schedule, ScheduleError
from .pairing import overlap_pairs
from .simulate import memory_levels
from .validate import check


@dataclass(frozen=True)
class ScheduleSpec:
    """What a generator is asked for. Costs and the memory limit use the CostModel's units."""

    pp: int
    microbatches: int
    chunks: int | None = None  # None: the generator's default
    costs: CostModel | None = None
    memory_limit: float | None = None  # per rank; None: unlimited
    refine_seconds: float = 0.0  # automatic schedules: time for the optional solver refinement
    # iterations overlap (optimizer post-validation): ``auto`` ranks by stage span, else by makespan
    post_validation: bool = False
    # breadth-first families: microbatches per group (None: all of them); m / group groups run in turn
    breadth_first_microbatches: int | None = None
    # the model's layers, when known: ``auto`` passes over placements whose blocks do not split them
    layers: int | None = None
    # run adjacent F and B (or BW) of a rank as overlapped pairs where that shortens the iteration (MoE all-to-all)
    overlap_f_b: bool = False

    def __post_init__(self) -> None:
        if self.memory_limit is not None and not (math.isfinite(self.memory_limit) and self.memory_limit > 0):
            raise ValueError(
                f"memory limit must be a finite number > 0 (or None for no limit), got {self.memory_limit}"
            )

    def cost_model(self) -> CostModel:
        return self.costs or CostModel(self.pp)


@dataclass(frozen=True)
class Generator:
    name: str
    summary: str
    generate: Callable[[ScheduleSpec], Schedule] = field(compare=False)
    composite: bool = False  # picks among the other schedules (``auto``); skipped when listing alternatives
    # optional ScheduleSpec fields it plans with (a flag for others has no effect): "breadth_first_microbatches",
    # "memory_limit" (it plans under the limit; every other schedule is only refused when it does not fit),
    # "chunks" (it plans any number of chunks per rank; the others run a fixed number), "overlap_f_b" (it places
    # the overlapped pairs itself, ranking its candidates paired; the others get theirs after, in ``build``)
    options: frozenset[str] = frozenset()
    weight_copies: int = 1  # copies of the model's weights per rank, against 1F1B's one (BitPipe: 2)


_GENERATORS: dict[str, Generator] = {}


def register(
    name: str, summary: str, composite: bool = False, options: tuple[str, ...] = (), weight_copies: int = 1
) -> Callable[[Callable[[ScheduleSpec], Schedule]], Callable]:
    def wrap(generate: Callable[[ScheduleSpec], Schedule]) -> Callable[[ScheduleSpec], Schedule]:
        if name in _GENERATORS:
            raise ValueError(f"schedule {name!r} is registered twice")
        planned = _without_collections(generate)
        _GENERATORS[name] = Generator(name, summary, planned, composite, frozenset(options), weight_copies)
        return planned

    return wrap


def _without_collections(generate: Callable[[ScheduleSpec], Schedule]) -> Callable[[ScheduleSpec], Schedule]:
    """``generate`` with Python's cyclic garbage collector paused while it runs. A planner allocates
    millions of small lists and tuples that live until it returns, and the collector kept walking
    them: 10 % of v-auto at pp 64, m 512 (0.4 of 4 s; a full collection of a decoded schedule's 10^5
    passes took two thirds of the decode). What is garbage is freed by reference counting as ever,
    and any cycle at the next collection after."""

    @wraps(generate)
    def planned(spec: ScheduleSpec) -> Schedule:
        if not gc.isenabled():
            return generate(spec)  # a generator called by another (``auto``), or a caller that paused it
        gc.disable()
        try:
            return generate(spec)
        finally:
            gc.enable()

    return planned


def _load() -> None:
    from . import generators  # noqa: F401  (registers the built-in generators)


def names() -> list[str]:
    _load()
    return sorted(_GENERATORS)


def with_option(option: str) -> list[str]:
    """The schedules whose generators plan with ``option`` (a ScheduleSpec field), by name."""
    return [name for name in names() if option in _GENERATORS[name].options]


def get(name: str) -> Generator:
    _load()
    if name not in _GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(names())}")
    return _GENERATORS[name]


def build(name: str, spec: ScheduleSpec, suggest: bool = True, checked: bool = True) -> Schedule:
    """Generate and validate; raises ScheduleError naming the setting that cannot work.

    A memory refusal lists the schedules that fit (``suggest``), which builds all of them. ``checked=False``:
    the plan as generated, neither validated nor held to the memory limit; for a caller that compares
    many plans and checks the one it returns (``auto``: its pick is validated when it is built).
    """
    if spec.pp < 1:
        raise ScheduleError(f"pp must be at least 1, got {spec.pp}")
    if spec.microbatches < 1:
        raise ScheduleError(f"microbatches must be at least 1, got {spec.microbatches}")
    if spec.costs is not None and spec.costs.pp != spec.pp:
        raise ScheduleError(f"the cost model is for pp={spec.costs.pp}, the schedule for pp={spec.pp}")
    generator = get(name)
    if spec.refine_seconds > 0:  # the solver is timed: its plans are never kept
        schedule = generator.generate(spec)
        if checked:
            check(schedule, spec.cost_model())
    else:
        schedule = (_planned if checked else _generated)(generator, _plans_with(generator, spec))
    key = pairs_key(spec)
    if key is not None and "overlap_f_b" not in generator.options:
        schedule = _paired(schedule, spec.cost_model(), key)
        if checked:
            check(schedule, spec.cost_model())
    if not checked:
        return schedule
    message = over_limit(name, schedule, spec)
    if message is not None:
        if suggest:
            fits = [f"{other} ({need:g})" for other, need in _peaks(spec) if need <= spec.memory_limit + 1e-9]
            message += f"; schedules that fit: {', '.join(fits) or 'none'}"
        raise ScheduleError(message)
    return schedule


def pairs_key(spec: ScheduleSpec) -> str | None:
    """What overlapped pairs are placed by for ``spec`` (``overlap_pairs``' key); None where it asks for none,
    or the costs have no all-to-all time to hide."""
    if not (spec.overlap_f_b and spec.cost_model().has_all_to_all):
        return None
    return "stage_span" if spec.post_validation else "makespan"


def over_limit(name: str, schedule: Schedule, spec: ScheduleSpec) -> str | None:
    """Why ``schedule`` does not fit ``spec.memory_limit`` (the memory it needs), or None when it fits."""
    if spec.memory_limit is None:
        return None
    return limit_refusal(name, peak_memory(schedule, spec.cost_model()), spec)


def limit_refusal(name: str, peak: float, spec: ScheduleSpec) -> str | None:
    """Why a plan that peaks at ``peak`` does not fit ``spec.memory_limit``, or None when it fits."""
    if spec.memory_limit is None or peak <= spec.memory_limit + 1e-9:
        return None
    return (
        f"{name} needs --memory-limit >= {peak:g} for pp={spec.pp}, microbatches={spec.microbatches}, "
        f"got {spec.memory_limit:g}"
    )


PLANS_KEPT = 64  # a plan at pp=32, m=256 holds a few MB


@lru_cache(maxsize=PLANS_KEPT)
def _generated(generator: Generator, spec: ScheduleSpec) -> Schedule:
    return generator.generate(spec)


@lru_cache(maxsize=PLANS_KEPT)
def _planned(generator: Generator, spec: ScheduleSpec) -> Schedule:
    schedule = _generated(generator, spec)
    check(schedule, spec.cost_model())
    return schedule


@lru_cache(maxsize=PLANS_KEPT)
def _paired(schedule: Schedule, costs: CostModel, key: str) -> Schedule:
    return overlap_pairs(schedule, costs, key)


def _plans_with(generator: Generator, spec: ScheduleSpec) -> ScheduleSpec:
    """``spec`` without the fields the generator does not plan with (the memory limit, for a schedule
    that is only refused when over it; the pairs, placed after, or asked for without all-to-all time), so
    one plan serves every spec that differs only there."""
    unread: dict = {}
    if "overlap_f_b" not in generator.options or pairs_key(spec) is None:
        unread["overlap_f_b"] = False
    if not generator.composite:
        unread.update(layers=None, post_validation=False)
    for option in ("memory_limit", "breadth_first_microbatches"):
        if option not in generator.options:
            unread[option] = None
    return replace(spec, **unread)


def peak_memory(schedule: Schedule, costs: CostModel) -> float:
    return max(max((0.0, *levels)) for levels in memory_levels(schedule, costs))


def _peaks(spec: ScheduleSpec) -> list[tuple[str, float]]:
    """Peak memory of every schedule that can run ``spec`` without a limit."""
    unlimited = replace(spec, memory_limit=None, chunks=None)
    found = []
    for other in names():
        if get(other).composite:
            continue
        try:
            found.append((other, peak_memory(build(other, unlimited), unlimited.cost_model())))
        except ScheduleError:
            continue
    return found
