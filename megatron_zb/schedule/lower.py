"""Lowering: the actions of a schedule beyond the compute passes a generator emits.

Generators never write these; the runtime, the simulator and the CLI lower a schedule with the
data-parallel setting of the run (``DataParallel``) and its costs:

- ``add_reduce_grad``: one REDUCE_GRAD per stage, right after the pass that completes its weight
  gradients (its last W or BW). That is where the chunk's gradient reduction starts (megatron
  DDP's bucket all-reduce, the distributed optimizer's reduce-scatter, ZeRO-3's reduce-scatter),
  overlapping the passes after it.
- ``add_gathers``: UNSHARD/RESHARD windows around the passes that run on a chunk's weights.
  ``gather="once"``: one UNSHARD before the chunk's first pass, kept to the end (the distributed
  optimizer's parameter all-gather after the previous step). ``gather="windows"``: ZeRO-3, one
  window per run of consecutive passes on the chunk's weights (no F, B or BW of another chunk
  of the rank in between; a W needs no weights and may run outside any window), released right
  after the run; each UNSHARD is issued ``prefetch`` compute passes before its run starts, so
  the gather overlaps them.
- ``add_all_to_all`` (last): where a stage runs expert-parallel all-to-alls (``CostModel.t_a2a``),
  each F is split into its all-to-alls (A2A_F, dispatch and combine of the block's MoE layers)
  and the rest, and each B or BW likewise (A2A_B). The all-to-all goes first: it waits for what
  the pass waits for, holds the compute stream (megatron-core's dispatcher is synchronous) and
  the rest follows, so a schedule without overlap keeps its timeline, the all-to-all's share
  now visible. The runtime still runs the all-to-all inside the pass (the action only books its
  time).

Overlapped pairs (``Schedule.overlapped``) stay adjacent: an action a pass above would put between
the two passes of a pair goes before the pair if the pair needs it (a gather, UNSHARD) and after it
otherwise (REDUCE_GRAD, REPLICA_SYNC, RESHARD: after the pair, not between its passes). With
``gather="windows"`` a pair on two chunks thus runs inside both chunks' windows. The all-to-alls of
paired passes are not split out: the pair's time (``CostModel.pair_time``) already counts them,
hidden behind the other pass's compute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .actions import PARTS, spec
from .costs import CostModel
from .ir import Pass, PassKind, Schedule, ScheduleError
from .simulate import simulate

GATHERS = ("none", "once", "windows")


@dataclass(frozen=True)
class DataParallel:
    """What the data-parallel side of a run needs planned."""

    reduce_grad: bool = True  # reduce each chunk's gradients once its weight gradients are complete
    gather: str = "none"  # none | once (ZeRO-1 parameter all-gather) | windows (ZeRO-3)
    prefetch: int = 1  # windows: compute passes between an UNSHARD and the first pass that needs it

    def __post_init__(self) -> None:
        if self.gather not in GATHERS:
            raise ScheduleError(f"gather must be one of {', '.join(GATHERS)}, got {self.gather!r}")
        if self.prefetch < 0:
            raise ScheduleError(f"prefetch must be >= 0 compute passes, got {self.prefetch}")


def lower(schedule: Schedule, data_parallel: DataParallel, costs: CostModel | None = None) -> Schedule:
    """``schedule`` (compute passes only) with the actions ``data_parallel`` asks for.

    A schedule that keeps two copies of blocks (``Schedule.shared``) always gets their
    REPLICA_SYNCs (``costs`` order them); the data-parallel reduction of such a block follows it.
    ``costs`` with all-to-all times also split the all-to-alls out of the passes (``add_all_to_all``).
    """
    if any(not p.kind.is_compute for order in schedule.orders for p in order):
        raise ScheduleError(f"{schedule.name} is already lowered: lower the compute schedule a generator returned")
    if schedule.shared:
        schedule = add_replica_sync(schedule, costs)
    if data_parallel.gather != "none":
        schedule = add_gathers(schedule, data_parallel.gather == "windows", data_parallel.prefetch)
    if data_parallel.reduce_grad:
        schedule = add_reduce_grad(schedule)
    if costs is not None and costs.has_all_to_all:  # last: each right before its pass, inside its window
        schedule = add_all_to_all(schedule, costs)
    return schedule


def _rejoin(schedule: Schedule, orders: list[tuple[Pass, ...]]) -> Schedule:
    """``schedule`` with ``orders``, each overlapped pair made adjacent again (see the module)."""
    if schedule.overlapped:
        partner = {first: second for pair in schedule.overlapped for first, second in (pair, pair[::-1])}
        orders = [_rejoined(order, partner) for order in orders]
    return replace(schedule, orders=tuple(orders))


def _rejoined(order: tuple[Pass, ...], partner: dict[Pass, Pass]) -> tuple[Pass, ...]:
    out: list[Pass] = []
    index = 0
    while index < len(order):
        p = order[index]
        index += 1
        if p not in partner:
            out.append(p)
            continue
        end = order.index(partner[p], index)
        before, after, late = [], [], set()
        for q in order[index:end]:  # in order; a stage's actions keep theirs (a gather after a release stays after)
            key = (q.pipe, q.stage)
            if spec(q.kind).gathers > 0 and key not in late:
                before.append(q)
            else:
                after.append(q)
                late.add(key)
        out += [*before, p, order[end], *after]
        index = end + 1
    return tuple(out)


def add_all_to_all(schedule: Schedule, costs: CostModel) -> Schedule:
    """Every F (B, BW) of a stage with all-to-all time (``costs.t_a2a``, ``t_a2a_b``) preceded by its all-to-all.

    The schedule comes back as it is where no stage has any. The all-to-all of a BW is the backward
    one (its B part's). Right before its pass, it lies in the pass's gather window, if any.
    """
    if costs.pp != schedule.pp:
        raise ScheduleError(f"cost model is for pp={costs.pp}, schedule {schedule.name} has pp={schedule.pp}")
    if any(spec(p.kind).part_of for order in schedule.orders for p in order):
        raise ScheduleError(f"{schedule.name} already has its all-to-alls split out of its passes")
    if not costs.has_all_to_all:
        return schedule
    paired = {p for pair in schedule.overlapped for p in pair}  # their time counts their all-to-alls
    orders = []
    for order in schedule.orders:
        lowered: list[Pass] = []
        for p in order:
            if p in paired:
                lowered.append(p)
                continue
            stage = schedule.placements[p.pipe].full_stage(p.stage)
            for role in spec(p.kind).roles:
                part = PARTS.get(role)
                if part is not None and any(getattr(costs, name)[stage] > 0 for name in spec(part).time):
                    lowered.append(Pass(part, p.stage, p.microbatch, p.pipe))
            lowered.append(p)
        orders.append(tuple(lowered))
    return replace(schedule, orders=tuple(orders))


def add_replica_sync(schedule: Schedule, costs: CostModel | None = None) -> Schedule:
    """A REPLICA_SYNC on both holders of every shared block, as early as both copies are done.

    Each rank issues it right after its own copy's last W, but the two ranks of a pair must
    issue their syncs in one order: pairs are ordered by when the later of their two copies
    finishes in the simulated compute schedule (then by block), and a sync waits in a rank's
    order for the one before it in that order.
    """
    timeline = simulate(schedule, costs)
    done: dict[tuple[int, int], tuple[int, int, float]] = {}  # block -> (rank, index of its last W, when)
    for rank, passes in enumerate(timeline.ranks):
        for index, t in enumerate(passes):
            if "W" in spec(t.pass_.kind).roles:
                done[t.pass_.pipe, t.pass_.stage] = (rank, index, t.end)
    pairs = sorted(schedule.shared, key=lambda pair: (max(done[b][2] for b in pair), sorted(pair)))
    after: dict[tuple[int, int], list[Pass]] = {}  # (rank, index) -> syncs placed after that pass
    cursor: dict[int, int] = {}  # rank -> index of the pass its latest sync follows
    for pair in pairs:
        for pipe, stage in pair:
            rank, index, _ = done[pipe, stage]
            index = max(index, cursor.get(rank, -1))
            cursor[rank] = index
            after.setdefault((rank, index), []).append(Pass(PassKind.REPLICA_SYNC, stage, 0, pipe))
    orders = []
    for rank, order in enumerate(schedule.orders):
        lowered: list[Pass] = []
        for index, p in enumerate(order):
            lowered.append(p)
            lowered += after.get((rank, index), [])
        orders.append(tuple(lowered))
    return _rejoin(schedule, orders)


def add_reduce_grad(schedule: Schedule) -> Schedule:
    """A REDUCE_GRAD for every stage, right after the pass that completes its weight gradients
    (or, for a block kept twice, right after its REPLICA_SYNC)."""
    orders = []
    for order in schedule.orders:
        last: dict[tuple[int, int], int] = {}
        for index, p in enumerate(order):
            if "W" in spec(p.kind).roles or p.kind is PassKind.REPLICA_SYNC:
                last[p.pipe, p.stage] = index
        after = {index: key for key, index in last.items()}
        lowered: list[Pass] = []
        for index, p in enumerate(order):
            lowered.append(p)
            if index in after:
                pipe, stage = after[index]
                lowered.append(Pass(PassKind.REDUCE_GRAD, stage, 0, pipe))
        orders.append(tuple(lowered))
    return _rejoin(schedule, orders)


def add_gathers(schedule: Schedule, per_run: bool, prefetch: int) -> Schedule:
    """UNSHARD/RESHARD windows: one per chunk for the whole iteration, or one per run of its passes."""
    orders = []
    for order in schedule.orders:
        runs = _runs(order) if per_run else _whole(order)
        before: dict[int, list[Pass]] = {}
        after: dict[int, list[Pass]] = {}
        released_at: dict[tuple[int, int], int] = {}  # where the chunk's previous window ended
        count: dict[tuple[int, int], int] = {}
        for key, first, last in runs:
            pipe, stage = key
            occurrence = count.get(key, 0)
            count[key] = occurrence + 1
            at = first if not per_run else max(first - prefetch, released_at.get(key, -1) + 1, 0)
            before.setdefault(at, []).append(Pass(PassKind.UNSHARD, stage, occurrence, pipe))
            if per_run:
                after.setdefault(last, []).append(Pass(PassKind.RESHARD, stage, occurrence, pipe))
                released_at[key] = last
        lowered: list[Pass] = []
        for index, p in enumerate(order):
            lowered += before.get(index, [])
            lowered.append(p)
            lowered += after.get(index, [])
        orders.append(tuple(lowered))
    return _rejoin(schedule, orders)


def _runs(order: tuple[Pass, ...]) -> list[tuple[tuple[int, int], int, int]]:
    """(stage key, first index, last index) of each run of consecutive passes on one stage's weights.

    Ws need no weights (they only add to gradients, which outlive a release), so they neither
    start nor break a run.
    """
    runs: list[tuple[tuple[int, int], int, int]] = []
    for index, p in enumerate(order):
        if not spec(p.kind).uses_weights:
            continue
        key = (p.pipe, p.stage)
        if runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1], index)
        else:
            runs.append((key, index, index))
    return runs


def _whole(order: tuple[Pass, ...]) -> list[tuple[tuple[int, int], int, int]]:
    """One window per stage, from its first pass on its weights to the end of the order."""
    first: dict[tuple[int, int], int] = {}
    for index, p in enumerate(order):
        if spec(p.kind).uses_weights:
            first.setdefault((p.pipe, p.stage), index)
    return sorted(((key, at, len(order) - 1) for key, at in first.items()), key=lambda item: item[1])
