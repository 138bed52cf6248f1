"""Measured pass times, turned into the simulator's cost model.

While ``active``, every pass is timed (data-parallel actions too: the host time of issuing them,
for traces; they are left out of the costs) (on a GPU the clock synchronises the device,
so profile a few iterations, not the whole run). ``cost_model()`` averages the times over
all pipeline ranks into per-stage T_F, T_B, T_W (the simulator's units: a full stage, 1/pp
of the layers, whatever the placement) and measures T_comm with a ping-pong of one boundary
tensor between neighbouring ranks. A profile of a placement with several blocks per stage also
gives what the model's ends add (``CostModel.t_f_ends``): the first block's time beyond the
other blocks of its stage (the embedding) and the last block's (output layer and loss).

The expert-parallel all-to-all runs inside the F and B passes (megatron-core's dispatcher),
so its time is taken there (``expert_comm``): each compute record carries the seconds its pass
spent in it, booked under the all-to-all kinds (A2A_F in an F, A2A_B in a B or BW) by
``stage_sums``; the cost model's T_a2a (t_a2a_b) is their mean over the F (B, BW) passes
(the A2A actions of a lowered schedule run nothing: the pass after them does the work).

An overlapped pair (``run_pair``) is timed as one step, its span split between its two records in
proportion to each side's compute (the seconds it held the turn), so that the records still tile
the rank's time; each side's all-to-all is metered on its own (that side's wait for its turn after
a collective included). Paired records carry their ``partner`` and are left out of the costs: a
pass's own time is not measured inside a pair, only the pair's (the span of its two records).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..schedule import CostModel, Pass, PassKind, Schedule
from ..schedule.actions import PARTS, spec
from ..schedule.costs import PerStage
from . import expert_comm

# The all-to-all kind a compute pass's communication is booked under, by the role that runs it.
ALL_TO_ALL = {role: kind.value for role, kind in PARTS.items()}


@dataclass(frozen=True)
class PassRecord:
    iteration: int
    pass_: Pass
    chunk: int
    start: float
    end: float
    waited: float = 0.0  # seconds blocked on this pass's receives (not in start..end)
    a2a: float = 0.0  # seconds of expert-parallel all-to-all inside it (in start..end)
    partner: Pass | None = None  # the pass it ran beside in an overlapped pair


@dataclass(frozen=True)
class CallRecord:
    """One executor run (one rank's passes of one iteration): its span and its P2P bookkeeping.

    ``posted`` is the time spent posting sends and receives and waiting for the last sends at
    the end; with the passes' ``waited`` and durations it splits the span (``training.idle``).
    """

    iteration: int
    start: float
    end: float
    posted: float


class PassProfiler:
    """Times passes while active; ``start()``/``stop()`` mark the iterations to measure."""

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self.active = False
        self.iteration = 0
        self.records: list[PassRecord] = []
        self.calls: deque[CallRecord] = deque(maxlen=256)  # the latest executor runs (bounded: kept across clears)

    def start(self) -> None:
        self.active = True

    def stop(self) -> None:
        self.active = False

    def next_iteration(self) -> None:
        self.iteration += 1

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run(self, p: Pass, chunk: int, fn, arg, waited=None) -> None:
        """Time ``fn(arg)``; time spent waiting for its inputs (``waited()`` grows by it) is not work."""
        before = waited() if waited is not None else 0.0
        with expert_comm.metering(self.now) as meter:
            start = self.now()
            fn(arg)
            end = self.now()
        idle = (waited() - before) if waited is not None else 0.0
        self.records.append(PassRecord(self.iteration, p, chunk, start + idle, end, idle, meter.seconds))

    def run_pair(
        self,
        pair: tuple[Pass, Pass],
        chunks: tuple[int, int],
        sides: tuple[Callable[[], object], Callable[[], object]],
        run: Callable[[Callable[[], object], Callable[[], object]], tuple[float, float]],
    ) -> None:
        """Time ``run(*sides)`` (an overlapped pair, which returns each side's compute seconds) as one step,
        each side's all-to-all metered in its own thread (see the module)."""
        metered = [0.0, 0.0]

        def side(index: int) -> Callable[[], object]:
            def go() -> object:
                with expert_comm.metering(self.now) as meter:
                    try:
                        return sides[index]()
                    finally:
                        metered[index] = meter.seconds

            return go

        start = self.now()
        held = run(side(0), side(1))
        end = self.now()
        share = held[0] / sum(held) if sum(held) > 0 else 0.5
        middle = start + (end - start) * share
        for index, (begin, finish) in enumerate(((start, middle), (middle, end))):
            self.records.append(
                PassRecord(
                    self.iteration, pair[index], chunks[index], begin, finish, 0.0, metered[index], pair[1 - index]
                )
            )

    def call(self, start: float, end: float, posted: float) -> None:
        """Record one executor run (see ``CallRecord``)."""
        self.calls.append(CallRecord(self.iteration, start, end, posted))

    def local_means(self, schedule: Schedule) -> dict[tuple[str, int], tuple[float, int]]:
        """(kind, full stage) -> (sum of per-stage-scaled seconds, count) on this rank."""
        return stage_sums(self.records, schedule)

    def local_blocks(self) -> dict[tuple[str, int], tuple[float, int]]:
        """(kind, block) -> (sum of seconds, count) on this rank."""
        return block_sums(self.records)

    def cost_model(
        self,
        schedule: Schedule,
        group: dist.ProcessGroup,
        boundary_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        w_share_when_fused: float = 0.5,
    ) -> CostModel:
        """Costs of this profiler's records averaged over every rank (see ``agreed_cost_model``)."""
        return agreed_cost_model(
            self.local_means(schedule),
            schedule,
            group,
            boundary_shape,
            dtype,
            self.device,
            w_share_when_fused,
            self.local_blocks(),
        )

    def kinds_seen(self) -> set[PassKind]:
        return {record.pass_.kind for record in self.records}


class NestedProfilers:
    """Two profilers on the same passes (the outer one's times include the inner one's bookkeeping)."""

    active = True

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def run(self, p: Pass, chunk: int, fn, arg, waited=None) -> None:
        self.outer.run(p, chunk, lambda x: self.inner.run(p, chunk, fn, x, waited), arg, waited)

    def run_pair(self, pair, chunks, sides, run) -> None:
        self.outer.run_pair(pair, chunks, sides, lambda *inner: self.inner.run_pair(pair, chunks, inner, run))

    def call(self, start: float, end: float, posted: float) -> None:
        self.outer.call(start, end, posted)
        self.inner.call(start, end, posted)


def stage_sums(records: list[PassRecord], schedule: Schedule) -> dict[tuple[str, int], tuple[float, int]]:
    """(kind, full stage) -> (sum of per-stage-scaled seconds, count) of ``records``."""
    sums: dict[tuple[str, int], tuple[float, int]] = {}
    for record in records:
        if not record.pass_.kind.is_compute or record.partner is not None:
            continue  # data-parallel actions: their host time is not a cost of the model; pairs: see the module
        placement = schedule.placements[record.pass_.pipe]
        stage = placement.full_stage(record.pass_.stage)
        seconds = (record.end - record.start) * placement.chunks
        add_sums(sums, {(record.pass_.kind.value, stage): (seconds, 1)})
        for role in spec(record.pass_.kind).roles:
            if role in ALL_TO_ALL:  # zero where the stage has no MoE layer: the mean stays honest
                add_sums(sums, {(ALL_TO_ALL[role], stage): (record.a2a * placement.chunks, 1)})
    return sums


def block_sums(records: list[PassRecord]) -> dict[tuple[str, int], tuple[float, int]]:
    """(kind, block) -> (sum of seconds, count) of ``records``: what each block's passes took, unscaled."""
    sums: dict[tuple[str, int], tuple[float, int]] = {}
    for record in records:
        if record.pass_.kind.is_compute and record.partner is None:
            add_sums(sums, {(record.pass_.kind.value, record.pass_.stage): (record.end - record.start, 1)})
    return sums


def add_sums(into: dict, more: dict) -> dict:
    """Fold one ``stage_sums`` result into another (several timed iterations)."""
    for key, (total, count) in more.items():
        before = into.get(key, (0.0, 0))
        into[key] = (before[0] + total, before[1] + count)
    return into


def agreed_cost_model(
    sums: dict[tuple[str, int], tuple[float, int]],
    schedule: Schedule,
    group: dist.ProcessGroup,
    boundary_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    w_share_when_fused: float = 0.5,
    blocks: dict[tuple[str, int], tuple[float, int]] | None = None,
) -> CostModel:
    """Costs (seconds) averaged over every rank's ``stage_sums`` (collective over the default group).

    Every rank gets the same model, so tensor- and data-parallel replicas keep planning the
    same schedule. ``group`` is this rank's pipeline group, where T_comm is measured. A
    fused BW is split with ``w_share_when_fused`` when the schedule ran no separate W (its
    all-to-all, if any, all in B).
    With ``blocks`` (every rank's ``block_sums``, or none on every rank) the ends' extras are
    measured too (``end_extras``).
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dict(sums), dict(blocks or {})))
    totals: dict[tuple[str, int], tuple[float, int]] = {}
    block_totals: dict[tuple[str, int], tuple[float, int]] = {}
    for rank_sums, rank_blocks in gathered:
        add_sums(totals, rank_sums)
        add_sums(block_totals, rank_blocks)

    def mean(kind: str, stage: int) -> float | None:
        total, count = totals.get((kind, stage), (0.0, 0))
        return total / count if count else None

    t_f, t_b, t_w, t_bw = [], [], [], []
    for stage in range(schedule.pp):
        f, b, w, bw = (mean(kind, stage) for kind in ("F", "B", "W", "BW"))
        if b is None and bw is not None:  # the backward all-to-all is B's: only the rest is shared with W
            a2a = min(mean(PassKind.A2A_B.value, stage) or 0.0, bw)
            b, w = a2a + (bw - a2a) * (1 - w_share_when_fused), (bw - a2a) * w_share_when_fused
        t_f.append(f or 0.0)
        t_b.append(b or 0.0)
        t_w.append(w or 0.0)
        t_bw.append(bw)
    t_comm = measure_latency(group, boundary_shape, dtype, device)
    per_stage = {"t_f": tuple(t_f), "t_b": tuple(t_b), "t_w": tuple(t_w)}
    if any(bw is not None for bw in t_bw):  # a stage that ran no BW: its split passes' sum
        per_stage["t_bw"] = tuple(b + w if bw is None else bw for b, w, bw in zip(t_b, t_w, t_bw, strict=True))
    ends = end_extras(block_totals, schedule, per_stage, w_share_when_fused)
    without_a2a = CostModel(schedule.pp, t_comm=t_comm, **per_stage, **ends)
    return replace(without_a2a, **all_to_all_times(totals, without_a2a))


def all_to_all_times(totals: dict[tuple[str, int], tuple[float, int]], costs: CostModel) -> dict[str, PerStage]:
    """``t_a2a`` and ``t_a2a_b`` per stage: the mean all-to-all seconds of the F records and of the B (BW)
    ones, each at most the layers' part of the pass time that holds it (noise must not make the model invalid)."""
    found = {}
    for kind in PARTS.values():
        (name,) = spec(kind).time  # t_a2a, t_a2a_b
        times = []
        for stage in range(costs.pp):
            total, count = totals.get((kind.value, stage), (0.0, 0))
            held = min(costs.layer_time(holder, stage) for holder in costs.holders(name))
            times.append(max(0.0, min(total / count if count else 0.0, held)))
        found[name] = tuple(times)
    return found


def end_extras(
    blocks: dict[tuple[str, int], tuple[float, int]],
    schedule: Schedule,
    per_stage: dict[str, tuple[float, ...]],
    w_share_when_fused: float = 0.5,
) -> dict[str, tuple[float, float]]:
    """``t_f_ends``, ``t_b_ends``, ``t_w_ends`` from the blocks' mean times (``block_sums``, all ranks), and
    ``t_bw_ends`` where ``per_stage`` has ``t_bw`` and an end's BW was measured (else derived by ``CostModel``).

    The first block's extra is its time beyond the mean of its stage's other blocks (they hold
    as many layers and no end); likewise the last block's. A placement with one block per stage
    (or a stage whose only other blocks are ends) measures none: zero, as before. Noise that
    makes an end faster than a plain block gives zero too, and an extra never exceeds the
    stage time that includes it.
    """
    placement, pp = schedule.placement, schedule.pp
    chunks, last = placement.chunks, placement.num_stages - 1

    def times(block: int) -> dict[str, float]:
        """Per time field, the block's mean seconds (a fused BW split as ``agreed_cost_model`` does)."""
        found = {}
        for kind, name in (("F", "t_f"), ("B", "t_b"), ("W", "t_w")):
            total, count = blocks.get((kind, block), (0.0, 0))
            if count:
                found[name] = total / count
        total, count = blocks.get(("BW", block), (0.0, 0))
        if count and "t_b" not in found:
            found["t_b"], found["t_w"] = total / count * (1 - w_share_when_fused), total / count * w_share_when_fused
        if count:
            found["t_bw"] = total / count
        return found

    def extra(end: int, stage: int) -> dict[str, float]:
        plain = [b for b in range(stage * chunks, (stage + 1) * chunks) if b not in (0, last)]
        if not plain:
            return {}
        own, others = times(end), [times(b) for b in plain]
        found = {}
        for name in per_stage:
            values = [o[name] for o in others if name in o]
            if name in own and len(values) == len(others):
                found[name] = min(max(own[name] - sum(values) / len(values), 0.0), per_stage[name][stage])
        return found

    first, final = extra(0, 0), extra(last, pp - 1)
    if pp == 1:  # both ends lie in the one stage: together at most its time
        for name in set(first) & set(final):
            final[name] = min(final[name], per_stage[name][0] - first[name])
    found = {f"{name}_ends": (first.get(name, 0.0), final.get(name, 0.0)) for name in ("t_f", "t_b", "t_w")}
    if "t_bw" in first or "t_bw" in final:
        found["t_bw_ends"] = (first.get("t_bw", 0.0), final.get("t_bw", 0.0))
    return found


def measure_latency(
    group: dist.ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rounds: int = 8
) -> float:
    """One-way time of one boundary tensor between neighbouring ranks (mean over pairs, rounds and pipelines).

    Collective over the default group; every pipeline measures its own pairs at the same time.
    """
    rank, size = group.rank(), group.size()
    if size == 1:
        return 0.0  # every pipeline has this size: all ranks return here
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    measured = torch.zeros(1, dtype=torch.float64, device=device)
    for left in range(size - 1):
        right = left + 1
        if rank not in (left, right):
            continue
        peer = dist.get_global_rank(group, right if rank == left else left)
        start = time.perf_counter()
        for _ in range(rounds):
            if rank == left:
                dist.send(tensor, peer, group=group)
                dist.recv(tensor, peer, group=group)
            else:
                dist.recv(tensor, peer, group=group)
                dist.send(tensor, peer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rank == left:
            measured += (time.perf_counter() - start) / (2 * rounds)
    dist.all_reduce(measured)  # every pipeline's pairs, so all ranks agree
    return float(measured.item()) / ((size - 1) * (dist.get_world_size() // size))
