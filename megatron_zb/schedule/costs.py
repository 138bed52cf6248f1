"""Per-stage pass costs and memory deltas, in the units every tool of the project shares.

Times and memory are given per full stage (1/pp of the layers) whatever the placement: a
block holding 1/chunks of a stage costs 1/chunks of it. Memory is counted in one
microbatch's activations of a full stage. T_comm is a latency per cross-rank edge. T_dp is the
time of one data-parallel collective over a full stage's weights or gradients (a gather or a
reduction), mem_param the memory a full stage's gathered weights take while gathered (ZeRO-3).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from .actions import spec
from .ir import Pass, ScheduleError
from .placement import Placement

PerStage = tuple[float, ...]
# Larger magnitudes make the simulator's sums lose the precision its 1e-9 comparisons rely on (or overflow).
MAX_MAGNITUDE = 1e15

FLAGS = {
    "t_f": "--cost-f",
    "t_b": "--cost-b",
    "t_w": "--cost-w",
    "t_comm": "--cost-comm",
    "mem_f": "--mem-f",
    "mem_b": "--mem-b",
    "mem_w": "--mem-w",
    "t_dp": "--cost-dp",
    "mem_param": "--mem-param",
}


def _name(field_name: str) -> str:
    return f"{field_name} ({FLAGS[field_name]})"


def _check_finite(name: str, values: Sequence[float]) -> None:
    """NaN and infinity never compare as a simulator expects (a NaN arrival is never ready: the planner would hang)."""
    bad = [v for v in values if not math.isfinite(v) or abs(v) > MAX_MAGNITUDE]
    if bad:
        raise ScheduleError(
            f"{_name(name)} must be finite numbers of magnitude at most {MAX_MAGNITUDE:g}, got {bad[0]!r}"
        )


def _per_stage(name: str, values: float | Sequence[float], pp: int) -> PerStage:
    if isinstance(values, bool) or (not isinstance(values, (int, float)) and any(isinstance(v, bool) for v in values)):
        raise ScheduleError(f"{_name(name)} must be numbers, got {values!r}")
    if isinstance(values, (int, float)):
        return (float(values),) * pp
    values = tuple(float(v) for v in values)
    if len(values) == 1:
        return values * pp
    if len(values) != pp:
        raise ScheduleError(f"{_name(name)} has {len(values)} values; give one number or one per stage (pp={pp})")
    return values


@dataclass(frozen=True)
class CostModel:
    pp: int
    t_f: PerStage = field(default=(1.0,))
    t_b: PerStage = field(default=(1.0,))
    t_w: PerStage = field(default=(1.0,))
    t_comm: float = 0.0
    mem_f: PerStage = field(default=(1.0,))
    mem_b: PerStage = field(default=(-0.5,))
    mem_w: PerStage = field(default=(-0.5,))
    t_dp: PerStage = field(default=(0.0,))
    mem_param: PerStage = field(default=(0.0,))

    def __post_init__(self) -> None:
        if isinstance(self.pp, bool) or not isinstance(self.pp, numbers.Integral) or self.pp < 1:
            raise ScheduleError(f"pp must be a whole number >= 1, got {self.pp!r}")
        for name in ("t_f", "t_b", "t_w", "mem_f", "mem_b", "mem_w", "t_dp", "mem_param"):
            object.__setattr__(self, name, _per_stage(name, getattr(self, name), self.pp))
        for name in ("t_f", "t_b", "t_w", "t_comm", "mem_f", "mem_b", "mem_w", "t_dp", "mem_param"):
            values = getattr(self, name)
            _check_finite(name, values if isinstance(values, tuple) else (values,))
        for name in ("t_f", "t_b", "t_w", "t_dp", "mem_param"):
            if any(v < 0 for v in getattr(self, name)):
                raise ScheduleError(f"{_name(name)} must not be negative: {getattr(self, name)}")
        if self.t_comm < 0:
            raise ScheduleError(f"{_name('t_comm')} must not be negative, got {self.t_comm}")
        if any(v < 0 for v in self.mem_f):
            raise ScheduleError(f"{_name('mem_f')} is what F allocates and must not be negative: {self.mem_f}")
        for stage in range(self.pp):
            total = self.mem_f[stage] + self.mem_b[stage] + self.mem_w[stage]
            if abs(total) > 1e-9:
                raise ScheduleError(
                    f"stage {stage}: mem_f + mem_b + mem_w (--mem-f/--mem-b/--mem-w) = {total:g}, must be 0 "
                    f"(B and W free what F allocated; e.g. mem_f=1, mem_b=-0.5, mem_w=-0.5)"
                )

    def duration(self, p: Pass, placement: Placement) -> float:
        """The pass's time: the fields its ``ActionSpec.time`` names, summed, for its share of a stage."""
        stage = placement.full_stage(p.stage)
        return sum(getattr(self, name)[stage] for name in spec(p.kind).time) / placement.chunks

    def memory_delta(self, p: Pass, placement: Placement) -> float:
        """What the pass allocates (+) or frees (-), as its ``ActionSpec`` names it, for its share of a stage."""
        kind, stage = spec(p.kind), placement.full_stage(p.stage)
        if kind.memory:
            return getattr(self, kind.memory)[stage] / placement.chunks
        if kind.frees:
            return -getattr(self, kind.frees)[stage] / placement.chunks
        return 0.0

    def work_per_microbatch(self, stage: int) -> float:
        return self.t_f[stage] + self.t_b[stage] + self.t_w[stage]
