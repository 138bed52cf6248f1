"""Re-planning once from measured pass times (the timer window of the zero-bubble flags).

Generators first plan with the costs they were given (unit costs by default), which misplace
W passes when stages differ (an extra layer, the embedding, the loss). The training
iterations of the window are timed. After its last one, every rank agrees on the measured
per-stage costs (averaged over all ranks), rank 0 plans with them and broadcasts the plan, so
every rank runs the same one even where planning is not deterministic (CP-SAT). The new plan
replaces the old only when it is predicted faster under the measured costs and keeps the
placement, because the model chunks are already built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..schedule import CostModel, Schedule, ScheduleError, schedule_from_data, schedule_to_data, simulate
from ..schedule.costs import ALL_TO_ALL, ENDS, OWN_ENDS
from ..schedule.costs_file import MeasuredCosts, save_costs
from .profiler import PassProfiler, add_sums, agreed_cost_model, block_sums, stage_sums

log = logging.getLogger("megatron_zb.replan")


@dataclass(frozen=True)
class ReplanWindow:
    """Time training calls ``start``..``end`` (1-based, inclusive, counted in this process), then re-plan."""

    start: int
    end: int
    costs_file: str | None = None  # rank 0 saves the measured costs here (``megatron-zb plan --costs-from``)

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.end:
            raise ValueError(
                f"re-planning window {self.start}..{self.end}: give 1 <= start <= end (training iterations)"
            )


@dataclass(frozen=True)
class ReplanReport:
    iterations: tuple[int, int]
    costs: CostModel  # measured, milliseconds per full stage
    old: str
    new: str
    planned_bubble: float  # the initial schedule under the costs it was planned with
    old_bubble: float  # the initial schedule under the measured costs
    new_bubble: float  # the re-planned schedule under the measured costs
    replaced: bool
    reason: str = ""
    pairs: int = 0  # overlapped F&B pairs of the new plan (Schedule.overlapped)
    times: tuple[float, float] | None = None  # predicted iteration (makespan, ms): the current plan, the new one

    def message(self) -> str:
        first, last = self.iterations
        costs = self.costs
        timed = (
            f"passes timed in iterations {first}-{last}: T_F {_ms(costs.t_f)}, T_B {_ms(costs.t_b)}, "
            f"T_W {_ms(costs.t_w)} ms per stage, "
            + (f"a fused BW {_ms(costs.t_bw)} ms, " if costs.t_bw is not None else "")
            + f"T_comm {costs.t_comm:.3g} ms"
            + (
                f", all-to-all {_ms(costs.t_a2a)} ms in T_F and {_ms(costs.t_a2a_b)} ms in T_B"
                if costs.has_all_to_all
                else ""
            )
        )
        if self.replaced:
            pairs = f" with {self.pairs} overlapped F&B pairs" if self.pairs else ""
            # A pair's hidden all-to-all is no longer work: its bubble share may grow while the iteration shortens.
            times = f", iteration {self.times[0]:.4g} -> {self.times[1]:.4g} ms" if self.pairs and self.times else ""
            return (
                f"re-planned {self.old} -> {self.new}{pairs} from the {timed}; predicted bubble "
                f"{self.old_bubble:.1%} -> {self.new_bubble:.1%}{times} (the initial plan predicted "
                f"{self.planned_bubble:.1%} with the costs it "
                "assumed)"
            )
        return f"kept {self.old} after the {timed}: {self.reason}"

    def to_dict(self) -> dict:
        return {
            "old": self.old,
            "new": self.new,
            "planned_bubble": self.planned_bubble,
            "old_bubble": self.old_bubble,
            "new_bubble": self.new_bubble,
            "replaced": self.replaced,
            "reason": self.reason,
            "pairs": self.pairs,
            "times": list(self.times) if self.times else None,
        }


class Replanner:
    """Counts training calls, times those in the window, and re-plans once after it."""

    def __init__(self, window: ReplanWindow):
        self.window = window
        self.calls = 0
        self.profiler = PassProfiler()
        self.sums: dict[tuple[str, int], tuple[float, int]] = {}
        self.blocks: dict[tuple[str, int], tuple[float, int]] = {}  # per block: what the ends add (t_f_ends, ...)
        self.report: ReplanReport | None = None

    def begin(self, device: torch.device) -> PassProfiler | None:
        """Count one training call; the profiler to time it with when it lies in the window."""
        self.calls += 1
        if self.report is not None or not self.window.start <= self.calls <= self.window.end:
            return None
        self.profiler.device = device
        self.profiler.start()
        return self.profiler

    def finish(self, schedule: Schedule) -> bool:
        """Fold the timed call's passes in; True after the window's last call."""
        self.profiler.stop()
        add_sums(self.sums, stage_sums(self.profiler.records, schedule))
        add_sums(self.blocks, block_sums(self.profiler.records))
        self.profiler.records.clear()
        return self.calls == self.window.end

    def replan(
        self,
        current: Schedule,
        planned_costs: CostModel | None,
        plan: Callable[[CostModel], Schedule],
        pipeline: dist.ProcessGroup,
        boundary_shape: tuple[int, ...],
        dtype: torch.dtype,
        memory_limit: float | None = None,
    ) -> tuple[Schedule, CostModel]:
        """The schedule every rank runs from now on, and the measured costs (collective over all ranks)."""
        seconds = agreed_cost_model(
            self.sums, current, pipeline, boundary_shape, dtype, self.profiler.device, blocks=self.blocks
        )
        costs = _milliseconds(seconds, planned_costs)
        payload: list = [None]
        if dist.get_rank() == 0:
            payload = [self._decide(current, planned_costs, plan, costs)]
        dist.broadcast_object_list(payload, src=0, device=_object_device(self.profiler.device))
        report, data = payload[0]
        chosen = current if data is None else schedule_from_data(data)  # whole: BitPipe's ``shared`` too
        self.report = report
        if dist.get_rank() == 0:
            _announce(report.message())
            if self.window.costs_file:
                self._save(costs, current, report, memory_limit)
        return chosen, costs

    def _decide(self, current: Schedule, planned_costs: CostModel | None, plan, costs: CostModel):
        planned = simulate(current, planned_costs or CostModel(current.pp)).bubble_rate
        before = simulate(current, costs)
        fields = dict(
            iterations=(self.window.start, self.window.end), costs=costs, old=current.name, planned_bubble=planned
        )
        try:
            candidate = plan(costs)
        except ScheduleError as error:
            reason = f"planning with them failed ({error})"
            return _kept(fields, before.bubble_rate, reason), None
        after = simulate(candidate, costs)
        if candidate.placements != current.placements:
            reason = (
                f"the best plan for them, {candidate.name}, places the layers as {candidate.placement.kind} "
                f"with {candidate.chunks} chunk(s) per rank, and the model is built for {current.placement.kind} "
                f"with {current.chunks}; restart with that schedule to use it"
            )
            return _kept(fields, before.bubble_rate, reason, candidate.name, after.bubble_rate), None
        if (after.stage_span, after.makespan) >= (before.stage_span * (1 - 1e-9), before.makespan * (1 - 1e-9)):
            reason = (
                f"planning with them predicts {after.bubble_rate:.1%} bubble, not below the current plan's "
                f"{before.bubble_rate:.1%}"
            )
            return _kept(fields, before.bubble_rate, reason, candidate.name, after.bubble_rate), None
        report = ReplanReport(
            **fields,
            new=candidate.name,
            old_bubble=before.bubble_rate,
            new_bubble=after.bubble_rate,
            replaced=True,
            pairs=len(candidate.overlapped),
            times=(before.makespan, after.makespan),
        )
        return report, schedule_to_data(candidate)

    def _save(self, costs: CostModel, current: Schedule, report: ReplanReport, memory_limit: float | None) -> None:
        measured = MeasuredCosts(
            costs,
            schedule=current.name,
            microbatches=current.microbatches,
            chunks=current.chunks,
            memory_limit=memory_limit,
            iterations=(self.window.start, self.window.end),
            extra={"replan": report.to_dict()},
        )
        save_costs(self.window.costs_file, measured)
        _announce(f"saved the measured costs to {self.window.costs_file} (megatron-zb plan --costs-from)")


def _announce(message: str) -> None:
    """Log it; print it where nothing handles our logger (a Megatron-LM script that configured no logging)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(message)
    else:
        print(f"megatron-zb: {message}", flush=True)


def _kept(fields: dict, bubble: float, reason: str, new: str | None = None, new_bubble: float | None = None):
    return ReplanReport(
        **fields,
        new=new or fields["old"],
        old_bubble=bubble,
        new_bubble=bubble if new_bubble is None else new_bubble,
        replaced=False,
        reason=reason,
    )


def _milliseconds(seconds: CostModel, planned: CostModel | None) -> CostModel:
    """Measured times in ms (readable in logs and plots); memory as the initial plan assumed it."""
    times = ("t_f", "t_b", "t_w", *ENDS.values(), *ALL_TO_ALL, *OWN_ENDS, *OWN_ENDS.values())
    given = {name: getattr(seconds, name) for name in times if getattr(seconds, name) is not None}
    costs = CostModel(
        seconds.pp,
        t_comm=1000 * seconds.t_comm,
        **{name: tuple(1000 * t for t in values) for name, values in given.items()},
    )
    if planned is None:
        return costs
    return replace(costs, mem_f=planned.mem_f, mem_b=planned.mem_b, mem_w=planned.mem_w)


def _object_device(device: torch.device) -> torch.device | None:
    return device if dist.get_backend() == "nccl" else None


def _ms(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
