"""Every schedule for one setting side by side, and the best one at the given memory.

``compare(spec)`` lists what ``auto`` chooses among, as rows of their own: each family at
every chunk count ``auto`` searches (``chunk_counts``), PyTorch's ZB-V, DualPipeV and
interleaved zero-bubble orders (``torch_orders``, named as PyTorch's classes), and ``auto``'s
pick; families that keep more weights than the limit measures are listed but not ranked. A
row over the memory limit, or one the family cannot plan, is listed as refused with the
reason (over the limit: the memory it needs). *Best* marks the rows ranked first as ``auto``
ranks (shortest makespan, then stage span, then peak; stage span first with post-validation),
so the best row is never worse than ``auto`` or a PyTorch order that fits. The Pareto frontier
of (max peak memory, stage-span bubble) is marked too. With ``spec.overlap_f_b`` every row runs
the overlapped F&B pairs that shorten it (PyTorch's orders too) and says how many (``pairs``).
Pure Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

from .schedule import comm
from .schedule.costs import CostModel
from .schedule.generators.auto import chunk_counts, splits_layers, torch_orders
from .schedule.ir import Schedule, ScheduleError
from .schedule.lower import DataParallel, lower
from .schedule.pairing import overlap_pairs
from .schedule.registry import ScheduleSpec, build, get, names, over_limit
from .schedule.simulate import Timeline, simulate
from .schedule.validate import check

EPS = 1e-9  # metrics closer than this count as equal (frontier ties, sorting)
FRONTIER_MARK = "*"
BEST_MARK = "best"
MAX_RANKS_SHOWN = 8  # the text table abbreviates longer per-rank peak lists; json has them all
HEAD = ("", "", "schedule", "chunks", "placement", "makespan", "bubble", "bubble(ms)", "peak", "peak per rank", "comm")
LEFT_ALIGNED = {0, 2, 4, 9}  # text columns; numbers are right-aligned
_TORCH_LABEL = re.compile(r"PyTorch's (\w+) order(.*)")  # how ``torch_orders`` names them


@dataclass(frozen=True)
class Row:
    """One schedule's numbers, or the reason it was refused (``refused``)."""

    name: str  # the family, with its chunk count where it is searched at several; a PyTorch class; "auto (pick)"
    refused: str | None = None
    chunks: int | None = None
    placement: str | None = None  # placement kinds, "+"-joined for schedules with several pipes
    makespan: float | None = None
    stage_span: float | None = None
    bubble_rate: float | None = None  # stage-span bubble
    bubble_rate_makespan: float | None = None
    peak_memory: tuple[float, ...] = ()  # per rank, in one microbatch's activations of a full stage
    comm_volume: int | None = None  # cross-rank transfers per iteration (comm.volume)
    frontier: bool = False
    family: str | None = None  # the registered schedule that made it (--schedule); None for PyTorch's orders
    weight_copies: int = 1  # copies of the weights per rank; only rows with one are ranked for best
    best: bool = False
    pairs: int = 0  # overlapped F&B pairs (--overlap-f-b)

    @property
    def built(self) -> bool:
        return self.refused is None

    @property
    def max_peak(self) -> float | None:
        return max(self.peak_memory) if self.peak_memory else None

    @classmethod
    def from_timeline(cls, name: str, timeline: Timeline, **fields) -> Row:
        schedule = timeline.schedule
        return cls(
            name=name,
            chunks=schedule.chunks,
            placement="+".join(placement.kind for placement in schedule.placements),
            makespan=timeline.makespan,
            stage_span=timeline.stage_span,
            bubble_rate=timeline.bubble_rate,
            bubble_rate_makespan=timeline.bubble_rate_makespan,
            peak_memory=timeline.peak_memory,
            comm_volume=comm.volume(schedule),
            pairs=len(schedule.overlapped),
            **fields,
        )

    def to_dict(self) -> dict:
        return {
            "schedule": self.name,
            "family": self.family,
            "refused": self.refused,
            "chunks": self.chunks,
            "placement": self.placement,
            "makespan": self.makespan,
            "stage_span": self.stage_span,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_makespan": self.bubble_rate_makespan,
            "peak_memory": list(self.peak_memory) if self.built else None,
            "max_peak_memory": self.max_peak,
            "comm_volume": self.comm_volume,
            "weight_copies": self.weight_copies,
            "pareto_frontier": self.frontier,
            "best": self.best,
            "overlapped_pairs": self.pairs,
        }


@dataclass(frozen=True)
class Comparison:
    pp: int
    microbatches: int
    chunks: int | None  # as requested; None: each family at every count auto searches
    memory_limit: float | None
    costs: CostModel
    rows: tuple[Row, ...]  # built rows by rank (``rank_key``), then refused rows by name
    post_validation: bool = False  # iterations overlap: best by stage span first
    overlap_f_b: bool = False  # rows run overlapped F&B pairs; the text table gets a pairs column

    @property
    def built(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if row.built)

    @property
    def refused(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if not row.built)

    @property
    def best(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if row.best)

    def row(self, name: str) -> Row:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    def setting(self) -> str:
        chunks = "searched" if self.chunks is None else str(self.chunks)
        limit = "none" if self.memory_limit is None else f"{self.memory_limit:g}"
        return f"pp={self.pp}  microbatches={self.microbatches}  chunks={chunks}  memory limit={limit}"

    def to_dict(self) -> dict:
        """The object ``megatron-zb compare --format json`` prints."""
        return {
            "pp": self.pp,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "memory_limit": self.memory_limit,
            "post_validation": self.post_validation,
            "overlap_f_b": self.overlap_f_b,
            "costs": asdict(self.costs),
            "rows": [row.to_dict() for row in self.rows],
        }

    def to_text(self) -> str:
        """A fixed-width table: the setting, one line per built schedule, then the refusals."""
        extra = (("pairs",), lambda row: (str(row.pairs),)) if self.overlap_f_b else ((), lambda row: ())
        cells = [HEAD + extra[0]] + [_cells(row) + extra[1](row) for row in self.built]
        widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
        lines = [
            f"megatron-zb compare  {self.setting()}",
            "bubble = stage-span bubble rate, bubble(ms) = makespan bubble rate, "
            "comm = cross-rank transfers per iteration",
            f"peak = activation memory in one microbatch's activations of a stage; {FRONTIER_MARK} = on the Pareto "
            "frontier of (peak, bubble)",
            f"{BEST_MARK} = {self._best_rule()}",
            *(["pairs = overlapped F&B pairs placed where they shorten the iteration (--overlap-f-b)"]
              if self.overlap_f_b else []),
            "",
        ]  # fmt: skip
        for line in cells:
            pairs = enumerate(zip(line, widths, strict=True))
            lines.append("  ".join(c.ljust(w) if i in LEFT_ALIGNED else c.rjust(w) for i, (c, w) in pairs).rstrip())
        if self.refused:
            lines += ["", "refused:"]
            width = max(len(row.name) for row in self.refused)
            lines += [f"  {row.name.ljust(width)}  {row.refused}" for row in self.refused]
        return "\n".join(lines) + "\n"

    def _best_rule(self) -> str:
        first = "stage span, then makespan" if self.post_validation else "makespan, then stage span"
        rule = f"ranked first as auto ranks: shortest {first}, then lowest peak"
        unranked = sorted({f"{row.name} ({row.weight_copies})" for row in self.built if row.weight_copies > 1})
        if unranked:
            rule += f"; not ranked, for their copies of the weights: {', '.join(unranked)}"
        return rule


def _num(value: float) -> str:
    return f"{value:.6g}"


def _per_rank(peaks: tuple[float, ...]) -> str:
    shown = [_num(v) for v in peaks]
    if len(shown) > MAX_RANKS_SHOWN:
        shown = [*shown[:4], "...", *shown[-2:]]
    return ",".join(shown)


def _cells(row: Row) -> tuple[str, ...]:
    return (
        BEST_MARK if row.best else "",
        FRONTIER_MARK if row.frontier else "",
        row.name,
        str(row.chunks),
        str(row.placement),
        _num(row.makespan),
        f"{row.bubble_rate:.2%}",
        f"{row.bubble_rate_makespan:.2%}",
        _num(row.max_peak),
        _per_rank(row.peak_memory),
        str(row.comm_volume),
    )


def dominates(a: Row, b: Row) -> bool:
    """``a`` is no worse than ``b`` on peak and bubble and better on at least one (lower is better)."""
    no_worse = a.max_peak <= b.max_peak + EPS and a.bubble_rate <= b.bubble_rate + EPS
    better = a.max_peak < b.max_peak - EPS or a.bubble_rate < b.bubble_rate - EPS
    return no_worse and better


def mark_frontier(rows: list[Row]) -> list[Row]:
    """Set ``frontier`` on built rows no other row dominates; equal points are all on it."""
    return [replace(row, frontier=not any(dominates(other, row) for other in rows)) for row in rows]


def rank_key(row: Row, post_validation: bool = False) -> tuple[float, float, float]:
    """What sets the iteration time, as ``auto`` ranks: makespan, stage span, peak (span first with post-validation)."""
    first = (row.stage_span, row.makespan) if post_validation else (row.makespan, row.stage_span)
    return (round(first[0], 9), round(first[1], 9), round(row.max_peak, 9))


def mark_best(rows: list[Row], post_validation: bool = False) -> list[Row]:
    """Set ``best`` on the ranked rows (one copy of the weights) that share the first ``rank_key``; ties all."""
    ranked = [rank_key(row, post_validation) for row in rows if row.weight_copies == 1]
    first = min(ranked, default=None)
    return [replace(row, best=row.weight_copies == 1 and rank_key(row, post_validation) == first) for row in rows]


Lowering = DataParallel | None


def _timed(name: str, schedule: Schedule, costs: CostModel, lowering: Lowering, **fields) -> Row:
    timeline = simulate(schedule if lowering is None else lower(schedule, lowering), costs)
    return Row.from_timeline(name, timeline, **fields)


def _refusal(name: str, error: ScheduleError, **fields) -> Row:
    reason = str(error).strip().splitlines()
    return Row(name, refused=reason[0] if reason else type(error).__name__, **fields)


def _check_layers(schedule: Schedule, spec: ScheduleSpec) -> None:
    """With ``spec.layers``, refuse a placement whose blocks do not split them, as ``auto`` passes it over."""
    if not splits_layers(schedule, spec):
        raise ScheduleError(f"its {schedule.chunks} chunk(s) per rank do not split {spec.layers} layers")


def _family_rows(family: str, spec: ScheduleSpec, lowering: Lowering) -> Iterator[Row]:
    """A family at each chunk count ``auto`` searches (if it plans any; else as it runs), named as ``auto`` names
    them; the counts it cannot run, or whose plan is over the memory limit, as refusals."""
    generator = get(family)
    searched = "chunks" in generator.options
    for chunks in chunk_counts(spec) if searched else (spec.chunks,):
        name = f"{family}, {chunks} chunks" if searched and chunks > 1 else family
        fields = {"family": family, "weight_copies": generator.weight_copies}
        try:
            schedule = build(family, replace(spec, chunks=chunks), suggest=False)
            _check_layers(schedule, spec)
            yield _timed(name, schedule, spec.costs, lowering, **fields)
        except ScheduleError as error:
            yield _refusal(name, error, chunks=chunks, **fields)


def torch_name(label: str) -> str:
    """``torch_orders``' label as PyTorch names the schedule: "PyTorch's DualPipeV order" -> "ScheduleDualPipeV"."""
    found = _TORCH_LABEL.fullmatch(label)
    return f"Schedule{found.group(1)}{found.group(2)}" if found else label


def _torch_rows(spec: ScheduleSpec, lowering: Lowering) -> Iterator[Row]:
    """PyTorch's orders where they run the setting; over the memory limit, refused with the memory they need."""
    for schedule in torch_orders(spec):
        name = torch_name(schedule.name)
        try:
            check(schedule, spec.costs)
            if spec.overlap_f_b and spec.costs.has_all_to_all:
                schedule = overlap_pairs(schedule, spec.costs, "stage_span" if spec.post_validation else "makespan")
            _check_layers(schedule, spec)
            too_big = over_limit(name, schedule, spec)
            if too_big is not None:
                raise ScheduleError(too_big)
            yield _timed(name, schedule, spec.costs, lowering)
        except ScheduleError as error:
            yield _refusal(name, error, chunks=schedule.chunks)


def _picker_rows(spec: ScheduleSpec, lowering: Lowering) -> Iterator[Row]:
    """Each composite schedule's pick (``auto``), named as it names itself: "auto (zb-v)"."""
    for family in names():
        if not get(family).composite:
            continue
        try:
            schedule = build(family, spec, suggest=False)
            yield _timed(schedule.name, schedule, spec.costs, lowering, family=family)
        except ScheduleError as error:
            yield _refusal(family, error, family=family)


def compare(spec: ScheduleSpec, data_parallel: DataParallel | None = None) -> Comparison:
    """Build and simulate every row for ``spec``'s setting (see the module docstring).

    With ``data_parallel`` each schedule is lowered with its data-parallel actions first.
    """
    if spec.memory_limit is not None and not math.isfinite(spec.memory_limit):
        raise ScheduleError(
            f"--memory-limit must be a finite number (leave it out for no limit), got {spec.memory_limit}"
        )
    spec = replace(spec, costs=spec.cost_model(), refine_seconds=0.0)
    rows = [row for family in names() if not get(family).composite for row in _family_rows(family, spec, data_parallel)]
    rows += [*_torch_rows(spec, data_parallel), *_picker_rows(spec, data_parallel)]
    built = mark_best(mark_frontier([row for row in rows if row.built]), spec.post_validation)
    refused = sorted((row for row in rows if not row.built), key=lambda row: row.name)
    built.sort(key=lambda row: (rank_key(row, spec.post_validation), row.name))
    return Comparison(
        spec.pp,
        spec.microbatches,
        spec.chunks,
        spec.memory_limit,
        spec.costs,
        (*built, *refused),
        spec.post_validation,
        spec.overlap_f_b,
    )
