"""What a planner returns: per-rank orders with their stage span, makespan and peak memory.

Planners run many candidates and keep one, so they record each pass as an integer code
(``timing.Encoding``) and only the chosen orders become ``Pass`` objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..costs import CostModel
from ..ir import Pass, Schedule
from ..placement import Placement
from ..timing import EPS, Clock, Encoding, Model, spans


@dataclass(frozen=True)
class Result:
    codes: list[list[int]]  # per rank, ``encoding``'s codes
    encoding: Encoding = field(compare=False)
    stage_span: float
    makespan: float
    peak: float
    label: str = field(default="", compare=False)  # what made it (a family's name, for ``auto``)
    _decoded: list = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of_clock(cls, clock: Clock) -> Result:
        span, makespan = clock.spans()
        return cls(clock.orders, clock.model.encoding, span, makespan, max(clock.peak, default=0.0))

    @property
    def orders(self) -> list[list[Pass]]:
        if not self._decoded:
            self._decoded.append([[self.encoding.decode(code) for code in order] for order in self.codes])
        return self._decoded[0]

    @property
    def microbatches(self) -> int:
        return self.encoding.microbatches

    @property
    def passes(self) -> int:
        return sum(map(len, self.codes))

    def score(self) -> tuple[float, float, float]:
        return (round(self.stage_span, 9), round(self.makespan, 9), round(self.peak, 9))


@lru_cache(maxsize=64)
def encoding_of(placements: tuple[Placement, ...], microbatches: int) -> Encoding:
    return Encoding(placements, microbatches)


@lru_cache(maxsize=64)
def model_of(placements: tuple[Placement, ...], microbatches: int, costs: CostModel | None) -> Model:
    """The timing model of a setting, built once per process (planners time many candidates on it)."""
    return Model(encoding_of(placements, microbatches), costs)


Placements = Placement | Sequence[Placement]


def _placements(placement: Placements) -> tuple[Placement, ...]:
    return (placement,) if isinstance(placement, Placement) else tuple(placement)


def timed_codes(codes: Sequence[Sequence[int]], placement: Placements, costs: CostModel, m: int) -> Result | None:
    """Stage span, makespan and peak memory of encoded orders; None if they deadlock."""
    model = model_of(_placements(placement), m, costs)
    timed = spans(model, codes)
    if timed is None:
        return None
    orders = [list(order) for order in codes]
    return Result(orders, model.encoding, *timed, max((model.peak(order) for order in orders), default=0.0))


def timed(orders: Sequence[Sequence[Pass]], placement: Placements, costs: CostModel, m: int) -> Result | None:
    """``timed_codes`` of orders of passes."""
    encode = encoding_of(_placements(placement), m).encode
    return timed_codes([[encode(p) for p in order] for order in orders], placement, costs, m)


RECALLED = 16  # plans remembered with their timing (``remember``)
# id(orders) -> (the orders, the costs they were timed on, their Result): the plans ``search.plan`` made
_TIMED: dict[int, tuple[tuple, CostModel, Result]] = {}


def remember(orders: tuple, costs: CostModel, result: Result) -> None:
    """Keep a plan's timing with its orders: ``auto`` times every family's plan again, and ``build`` takes
    its peak, on orders of 10^5 passes that the planner has just timed."""
    _TIMED.pop(id(orders), None)
    _TIMED[id(orders)] = (orders, costs, result)
    while len(_TIMED) > RECALLED:
        _TIMED.pop(next(iter(_TIMED)))


def recalled(schedule: Schedule, costs: CostModel) -> Result | None:
    """The timing ``remember`` kept for these very orders on these costs, or None."""
    kept = _TIMED.get(id(schedule.orders))
    if kept is None or kept[0] is not schedule.orders or kept[1] != costs:
        return None
    result = kept[2]
    same = result.encoding.placements == schedule.placements and result.microbatches == schedule.microbatches
    return result if same else None


def peak(schedule: Schedule, costs: CostModel) -> float:
    """The most memory a rank of ``schedule`` holds (its order alone sets it), without timing it."""
    known = recalled(schedule, costs)
    if known is not None:
        return known.peak
    placements, m = schedule.placements, schedule.microbatches
    encode, model = encoding_of(placements, m).encode, model_of(placements, m, costs)
    return max((model.peak([encode(p) for p in order]) for order in schedule.orders), default=0.0)


def timed_schedule(schedule: Schedule, costs: CostModel, limit: float | None = None) -> Result | None:
    """A schedule's orders timed, labelled with its name; None if they deadlock or, before any timing,
    if a rank's memory goes over ``limit`` (the order alone sets it)."""
    known = recalled(schedule, costs)
    if known is not None:
        return None if limit is not None and known.peak > limit + EPS else replace(known, label=schedule.name)
    placements, m = schedule.placements, schedule.microbatches
    encode = encoding_of(placements, m).encode
    codes = [[encode(p) for p in order] for order in schedule.orders]
    if limit is not None:
        model = model_of(placements, m, costs)
        if any(model.peak(order) > limit + EPS for order in codes):
            return None
    result = timed_codes(codes, placements, costs, m)
    if result is None:
        return None
    remember(schedule.orders, costs, result)
    return replace(result, label=schedule.name)
