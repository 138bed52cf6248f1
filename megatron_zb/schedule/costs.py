"""Per-stage pass costs and memory deltas, in the units every tool of the project shares.

Times and memory are given per full stage (1/pp of the layers) whatever the placement: a
block holding 1/chunks of a stage costs 1/chunks of it, except for what the ends of the model
add. The first block holds the embedding, the last the output layer and the loss, whatever
the placement puts them with (the V puts both on rank 0): ``t_f_ends`` (and ``t_b_ends``,
``t_w_ends``) is the pair (first block's extra, last block's extra), already inside the first
and the last stage's time. A block of a stage costs its share of the stage's time without
the extra, plus the extra if it is the first or last block. Memory is counted in one
microbatch's activations of a full stage. T_comm is a latency per cross-rank edge. T_dp is the
time of one data-parallel collective over a full stage's weights or gradients (a gather or a
reduction), mem_param the memory a full stage's gathered weights take while gathered (ZeRO-3).
T_a2a is the time of one microbatch's expert-parallel all-to-alls on a full stage in the
forward (dispatch and combine of every MoE layer; 0 without MoE layers), t_a2a_b that of their
backward, which moves as many tokens (by default the same; measured, it differs: the forward
also exchanges the token counts and waits for the slowest rank of the group). Like the ends'
extras they are parts of the pass times that already contain them: t_f holds the forward
all-to-alls, t_b their backward, so each is at most its pass's time less the ends' extras (the
embedding and the loss hold no MoE layer). Planners of compute passes need nothing of them;
lowering splits them out of the passes (``lower.add_all_to_all``). Overlap is the share of the
hideable time an overlapped F&B pair hides (``Schedule.overlapped``, ``pair_time``): 1 for two ideal
streams; measured, it can be lower, or negative where a pair runs slower than its passes one after
the other. A fused BW (B and W in one backward) costs ``t_bw`` where it was measured (a schedule that
runs BWs, like 1F1B, profiled it; on some machines the fused backward is cheaper than its split),
and ``t_b + t_w`` without it; ``t_bw_ends`` are its ends' extras (without them: B's plus W's).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from .actions import PARTS, SPECS, spec
from .ir import Pass, ScheduleError
from .placement import Placement

PerStage = tuple[float, ...]
Ends = tuple[float, float]  # (the first block's extra, the last block's extra)
# Which time field each ends field adds to.
ENDS = {"t_f": "t_f_ends", "t_b": "t_b_ends", "t_w": "t_w_ends"}
# A time measured for a kind itself (``ActionSpec.own_time``): its ends' field, given or else derived.
OWN_ENDS = {"t_bw": "t_bw_ends"}
# Larger magnitudes make the simulator's sums lose the precision its 1e-9 comparisons rely on (or overflow).
MAX_MAGNITUDE = 1e15

FLAGS = {
    "t_f": "--cost-f",
    "t_b": "--cost-b",
    "t_w": "--cost-w",
    "t_bw": "--cost-bw",
    "t_comm": "--cost-comm",
    "mem_f": "--mem-f",
    "mem_b": "--mem-b",
    "mem_w": "--mem-w",
    "t_dp": "--cost-dp",
    "mem_param": "--mem-param",
    "t_a2a": "--cost-a2a",
    "t_a2a_b": "--cost-a2a, which gives both directions",
    "overlap": "--cost-overlap",
}
# Which pass time holds each all-to-all time.
ALL_TO_ALL = {"t_a2a": "t_f", "t_a2a_b": "t_b"}


def _name(field_name: str) -> str:
    return f"{field_name} ({FLAGS[field_name]})" if field_name in FLAGS else field_name


def _check_finite(name: str, values: Sequence[float]) -> None:
    """NaN and infinity never compare as a simulator expects (a NaN arrival is never ready: the planner would hang)."""
    bad = [v for v in values if not math.isfinite(v) or abs(v) > MAX_MAGNITUDE]
    if bad:
        raise ScheduleError(
            f"{_name(name)} must be finite numbers of magnitude at most {MAX_MAGNITUDE:g}, got {bad[0]!r}"
        )


def _ends(name: str, values: Sequence[float], per_stage: PerStage) -> Ends:
    """Two numbers, each at most the stage time it is part of (both in stage 0 when pp = 1)."""
    if isinstance(values, (int, float, bool)) or len(values) != 2 or any(isinstance(v, bool) for v in values):
        raise ScheduleError(
            f"{_name(name)} must be two numbers (first block's extra, last block's extra), got {values!r}"
        )
    first, last = (float(v) for v in values)
    _check_finite(name, (first, last))
    if first < 0 or last < 0:
        raise ScheduleError(f"{_name(name)} must not be negative: {(first, last)}")
    within = [(first, 0), (last, len(per_stage) - 1)]
    if len(per_stage) == 1:
        within = [(first + last, 0)]
    for extra, stage in within:
        if extra > per_stage[stage] * (1 + 1e-9):
            raise ScheduleError(
                f"{_name(name)}: an extra of {extra:g} is more than stage {stage}'s whole time {per_stage[stage]:g}, "
                "which includes it"
            )
    return first, last


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
    t_f_ends: Ends = (0.0, 0.0)
    t_b_ends: Ends = (0.0, 0.0)
    t_w_ends: Ends = (0.0, 0.0)
    t_a2a: PerStage = field(default=(0.0,))
    t_a2a_b: PerStage | None = None  # None: as t_a2a
    overlap: float = 1.0  # share of the hideable time an overlapped F&B pair hides, in [-1, 1]
    t_bw: PerStage | None = None  # a fused BW's time; None: t_b + t_w
    t_bw_ends: Ends | None = None  # its ends' extras; None: t_b_ends + t_w_ends (at most t_bw)

    def __post_init__(self) -> None:
        if isinstance(self.pp, bool) or not isinstance(self.pp, numbers.Integral) or self.pp < 1:
            raise ScheduleError(f"pp must be a whole number >= 1, got {self.pp!r}")
        if self.t_a2a_b is None:
            object.__setattr__(self, "t_a2a_b", self.t_a2a)
        for name in ("t_f", "t_b", "t_w", "mem_f", "mem_b", "mem_w", "t_dp", "mem_param", "t_a2a", "t_a2a_b"):
            object.__setattr__(self, name, _per_stage(name, getattr(self, name), self.pp))
        for name in ("t_f", "t_b", "t_w", "t_comm", "mem_f", "mem_b", "mem_w", "t_dp", "mem_param", "t_a2a", "t_a2a_b"):
            values = getattr(self, name)
            _check_finite(name, values if isinstance(values, tuple) else (values,))
        for name in ("t_f", "t_b", "t_w", "t_dp", "mem_param", "t_a2a", "t_a2a_b"):
            if any(v < 0 for v in getattr(self, name)):
                raise ScheduleError(f"{_name(name)} must not be negative: {getattr(self, name)}")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, numbers.Real) or not -1 <= self.overlap <= 1:
            raise ScheduleError(
                f"{_name('overlap')} must be a number from -1 to 1 (1: a pair hides all it can, 0: nothing), "
                f"got {self.overlap!r}"
            )
        object.__setattr__(self, "overlap", float(self.overlap))
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
        for name, ends_name in ENDS.items():
            object.__setattr__(self, ends_name, _ends(ends_name, getattr(self, ends_name), getattr(self, name)))
        # Not a field: planners call ``duration`` millions of times, and most models have no ends.
        ends = {n: getattr(self, e) for n, e in ENDS.items() if any(getattr(self, e))}
        ends.update(self._own_ends())
        object.__setattr__(self, "_ends", ends)
        # Each kind's time fields: its own measured time where given, else the sum its spec names.
        names = {}
        for kind, action in SPECS.items():
            own = bool(action.own_time) and getattr(self, action.own_time) is not None
            names[kind] = (action.own_time,) if own else action.time
        object.__setattr__(self, "_names", names)
        self._check_all_to_all()

    def _own_ends(self) -> dict[str, Ends]:
        """Check ``t_bw`` and its ends; its ends' extras, given or derived from B's and W's."""
        if self.t_bw is None:
            if self.t_bw_ends is not None:
                raise ScheduleError(f"t_bw_ends {self.t_bw_ends!r} needs {_name('t_bw')}, which is not given")
            return {}
        per_stage = _per_stage("t_bw", self.t_bw, self.pp)
        _check_finite("t_bw", per_stage)
        if any(v < 0 for v in per_stage):
            raise ScheduleError(f"{_name('t_bw')} must not be negative: {per_stage}")
        object.__setattr__(self, "t_bw", per_stage)
        if self.t_bw_ends is None:  # B's and W's extras, each end at most what its stage leaves
            first = min(self.t_b_ends[0] + self.t_w_ends[0], per_stage[0])
            last = min(self.t_b_ends[1] + self.t_w_ends[1], per_stage[-1] - (first if self.pp == 1 else 0.0))
            ends = (first, last)
        else:
            ends = _ends("t_bw_ends", self.t_bw_ends, per_stage)
            object.__setattr__(self, "t_bw_ends", ends)
        return {"t_bw": ends} if any(ends) else {}

    def _check_all_to_all(self) -> None:
        """T_a2a is inside t_f, t_a2a_b inside t_b, beside the ends' extras (which hold no MoE layer)."""
        for a2a_name, name in ((a, h) for a in ALL_TO_ALL for h in self.holders(a)):
            for stage, a2a in enumerate(getattr(self, a2a_name)):
                layers = self.layer_time(name, stage)
                if a2a > layers * (1 + 1e-9) + 1e-12:
                    within = f"{_name(name)} {getattr(self, name)[stage]:g}"
                    if layers != getattr(self, name)[stage]:
                        within += f" less the ends' extra ({_name({**ENDS, **OWN_ENDS}[name])}), {layers:g},"
                    raise ScheduleError(
                        f"{_name(a2a_name)} of stage {stage} is {a2a:g}, more than {within} which includes it "
                        f"(the all-to-alls run inside the {name[2:].upper()} pass); give at most {layers:g}"
                    )

    def holders(self, a2a_name: str) -> tuple[str, ...]:
        """The pass times that contain an all-to-all time: t_f holds t_a2a; t_b, and t_bw where given, t_a2a_b."""
        holder = ALL_TO_ALL[a2a_name]
        return (holder, "t_bw") if holder == "t_b" and self.t_bw is not None else (holder,)

    def layer_time(self, name: str, stage: int) -> float:
        """The full stage's ``name`` time without what the model's ends add to it."""
        first, last = self._ends.get(name, (0.0, 0.0))
        return getattr(self, name)[stage] - (first if stage == 0 else 0.0) - (last if stage == self.pp - 1 else 0.0)

    @property
    def has_all_to_all(self) -> bool:
        """Whether any stage runs an expert-parallel all-to-all (lowering then splits it out)."""
        return any(self.t_a2a) or any(self.t_a2a_b)

    def duration(self, p: Pass, placement: Placement) -> float:
        """The pass's time: the fields its ``ActionSpec.time`` names, summed, for its block (see the module)."""
        stage = placement.full_stage(p.stage)
        names = self._names[p.kind]
        if placement.chunks == 1 or not self._ends:  # a block is the whole stage, ends and all
            return sum(getattr(self, name)[stage] for name in names) / placement.chunks
        return sum(self._block_time(name, p.stage, placement) for name in names)

    def _block_time(self, name: str, block: int, placement: Placement) -> float:
        stage, last = placement.full_stage(block), placement.num_stages - 1
        first_extra, last_extra = self._ends.get(name, (0.0, 0.0))
        layers = getattr(self, name)[stage]
        layers -= (first_extra if stage == 0 else 0.0) + (last_extra if stage == self.pp - 1 else 0.0)
        own = (first_extra if block == 0 else 0.0) + (last_extra if block == last else 0.0)
        return layers / placement.chunks + own

    def block_work(self, block: int, placement: Placement) -> float:
        """F + B + W of one microbatch on ``block`` of ``placement`` (a rank's work sums its blocks')."""
        return sum(self._block_time(name, block, placement) for name in ENDS)

    def pair_time(self, forward: Pass, backward: Pass, placements: Sequence[Placement]) -> float:
        """An overlapped pair's time: both passes less ``overlap`` times what the pair can hide.

        Each pass is its all-to-all (a) and the rest (c); two streams hide the smaller of the two sums,
        so the ideal pair takes max(c_f + c_b, a_f + a_b). Without all-to-all time a pair gains nothing.
        """
        whole = [self.duration(p, placements[p.pipe]) for p in (forward, backward)]
        parts = [self.duration(Pass(PARTS[role], p.stage, p.microbatch, p.pipe), placements[p.pipe])
                 for p, role in ((forward, "F"), (backward, "B"))]  # fmt: skip
        hideable = min(sum(parts), sum(whole) - sum(parts))
        return sum(whole) - self.overlap * hideable

    @property
    def has_ends(self) -> bool:
        """Whether the first or last block costs more than its share of its stage."""
        return bool(self._ends)

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
