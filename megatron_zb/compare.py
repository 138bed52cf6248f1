"""Every registered schedule for one setting, side by side: bubbles, memory, communication.

``compare(spec)`` builds each non-composite schedule with the same pp, microbatches, cost
model and memory limit (chunks: each generator's default unless the spec names one), and
marks the Pareto frontier of (max peak memory, stage-span bubble): the schedules that no
other built schedule beats on one metric without losing on the other. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .schedule import comm
from .schedule.costs import CostModel
from .schedule.ir import ScheduleError
from .schedule.lower import DataParallel, lower
from .schedule.registry import ScheduleSpec, build, get, names
from .schedule.simulate import Timeline, simulate

EPS = 1e-9  # metrics closer than this count as equal (frontier ties, sorting)
FRONTIER_MARK = "*"
MAX_RANKS_SHOWN = 8  # the text table abbreviates longer per-rank peak lists; json has them all
HEAD = ("", "schedule", "chunks", "placement", "makespan", "bubble", "bubble(ms)", "peak", "peak per rank", "comm")
LEFT_ALIGNED = {1, 3, 8}  # text columns; numbers are right-aligned


@dataclass(frozen=True)
class Row:
    """One schedule's numbers, or the reason the registry refused it (``refused``)."""

    name: str
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

    @property
    def built(self) -> bool:
        return self.refused is None

    @property
    def max_peak(self) -> float | None:
        return max(self.peak_memory) if self.peak_memory else None

    @classmethod
    def from_timeline(cls, name: str, timeline: Timeline) -> Row:
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
        )

    def to_dict(self) -> dict:
        return {
            "schedule": self.name,
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
            "pareto_frontier": self.frontier,
        }


@dataclass(frozen=True)
class Comparison:
    pp: int
    microbatches: int
    chunks: int | None  # as requested; None: each schedule's default
    memory_limit: float | None
    costs: CostModel
    rows: tuple[Row, ...]  # built rows by (bubble, peak, name), then refused rows by name

    @property
    def built(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if row.built)

    @property
    def refused(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if not row.built)

    def row(self, name: str) -> Row:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    def setting(self) -> str:
        chunks = "default" if self.chunks is None else str(self.chunks)
        limit = "none" if self.memory_limit is None else f"{self.memory_limit:g}"
        return f"pp={self.pp}  microbatches={self.microbatches}  chunks={chunks}  memory limit={limit}"

    def to_dict(self) -> dict:
        """The object ``megatron-zb compare --format json`` prints."""
        return {
            "pp": self.pp,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "memory_limit": self.memory_limit,
            "costs": asdict(self.costs),
            "rows": [row.to_dict() for row in self.rows],
        }

    def to_text(self) -> str:
        """A fixed-width table: the setting, one line per built schedule, then the refusals."""
        cells = [HEAD] + [_cells(row) for row in self.built]
        widths = [max(len(line[i]) for line in cells) for i in range(len(HEAD))]
        lines = [
            f"megatron-zb compare  {self.setting()}",
            "bubble = stage-span bubble rate, bubble(ms) = makespan bubble rate, "
            "comm = cross-rank transfers per iteration",
            f"peak = activation memory in one microbatch's activations of a stage; {FRONTIER_MARK} = on the Pareto "
            "frontier of (peak, bubble)",
            "",
        ]
        for line in cells:
            pairs = enumerate(zip(line, widths, strict=True))
            lines.append("  ".join(c.ljust(w) if i in LEFT_ALIGNED else c.rjust(w) for i, (c, w) in pairs).rstrip())
        if self.refused:
            lines += ["", "refused:"]
            width = max(len(row.name) for row in self.refused)
            lines += [f"  {row.name.ljust(width)}  {row.refused}" for row in self.refused]
        return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    return f"{value:.6g}"


def _per_rank(peaks: tuple[float, ...]) -> str:
    shown = [_num(v) for v in peaks]
    if len(shown) > MAX_RANKS_SHOWN:
        shown = [*shown[:4], "...", *shown[-2:]]
    return ",".join(shown)


def _cells(row: Row) -> tuple[str, ...]:
    return (
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


def _sort_key(row: Row) -> tuple:
    return (round(row.bubble_rate, 9), round(row.max_peak, 9), row.name)


def compare(spec: ScheduleSpec, data_parallel: DataParallel | None = None) -> Comparison:
    """Build and simulate every non-composite registered schedule for ``spec``'s setting.

    With ``data_parallel`` each schedule is lowered with its data-parallel actions first.
    """
    if spec.memory_limit is not None and not math.isfinite(spec.memory_limit):
        raise ScheduleError(
            f"--memory-limit must be a finite number (leave it out for no limit), got {spec.memory_limit}"
        )
    costs = spec.cost_model()
    spec = replace(spec, costs=costs)
    built, refused = [], []
    for name in names():
        if get(name).composite:
            continue
        try:
            schedule = build(name, spec)
            timeline = simulate(schedule if data_parallel is None else lower(schedule, data_parallel), costs)
        except ScheduleError as error:
            reason = str(error).strip().splitlines()
            refused.append(Row(name, refused=reason[0] if reason else type(error).__name__))
            continue
        built.append(Row.from_timeline(name, timeline))
    rows = sorted(mark_frontier(built), key=_sort_key) + sorted(refused, key=lambda row: row.name)
    return Comparison(spec.pp, spec.microbatches, spec.chunks, spec.memory_limit, costs, tuple(rows))
