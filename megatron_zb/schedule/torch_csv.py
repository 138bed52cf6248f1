"""PyTorch's schedule CSV (torch.distributed.pipelining ``_dump_csv``/``_load_csv``, torchtitan's
``pipeline_parallel_schedule_csv``), read into our IR and written from it.

One row per rank, one action per cell, ``{stage}{type}{microbatch}``: ``2F0``, ``1I3``, ``0W3``,
``3B1``; an empty cell is an idle step. Stages are numbered in layer order over the whole
model, as our blocks are, and a stage belongs to the rank whose row runs it; the placement is
inferred from that and must be PyTorch's "loop" or "v" style (or one stage per rank).

What each PyTorch action becomes is decided in one table, ``ACTIONS``:

- ``F``, ``I`` (input backward), ``W``, ``B`` (full backward) are our ``F``, ``B``, ``W``, ``BW``;
  ``(…;…)OVERLAP_F_B`` of one F and one ``I`` or ``B`` is an overlapped pair of ours
  (``Schedule.overlapped``), and our pairs are written as one; with other contents it runs its
  sub-actions one after the other, as PyTorch's runtime does.
- ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` are checked against the compute order (each on the
  rank of its stage, a send after the pass that produced its tensor, a receive before the pass
  that consumes it, one of each per cross-rank edge) and then dropped: our messages are
  derived from the compute order (``comm.py``).
- ``UNSHARD``/``RESHARD`` (FSDP) and ``REDUCE_GRAD`` (data-parallel gradient reduction) are our
  actions of the same names (numbered by their occurrence on the stage, in order); they must be
  on the rank of their stage, and the validator checks the rest (a pass on released weights, a
  reduction before a W of its stage).

Anything that does not fit raises ``ScheduleError`` naming the rank, the step and the cell.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum

from .actions import spec
from .ir import Pass, PassKind, Schedule, ScheduleError
from .placement import Placement, interleaved, linear, v_shape


class Treatment(str, Enum):
    COMPUTE = "compute"  # becomes a pass of ours
    P2P = "p2p"  # checked against the compute order, then dropped
    DATA_PARALLEL = "data-parallel"  # becomes one of our per-stage actions (no microbatch)


@dataclass(frozen=True)
class ActionType:
    treatment: Treatment
    kind: PassKind | None = None  # our pass, for compute actions


# PyTorch's _ComputationType values -> what the reader does with them. The one place to change
# when the IR gains communication or sharding actions.
ACTIONS = {
    "F": ActionType(Treatment.COMPUTE, PassKind.F),
    "I": ActionType(Treatment.COMPUTE, PassKind.B),
    "W": ActionType(Treatment.COMPUTE, PassKind.W),
    "B": ActionType(Treatment.COMPUTE, PassKind.BW),
    "SEND_F": ActionType(Treatment.P2P),
    "RECV_F": ActionType(Treatment.P2P),
    "SEND_B": ActionType(Treatment.P2P),
    "RECV_B": ActionType(Treatment.P2P),
    "UNSHARD": ActionType(Treatment.DATA_PARALLEL, PassKind.UNSHARD),
    "RESHARD": ActionType(Treatment.DATA_PARALLEL, PassKind.RESHARD),
    "REDUCE_GRAD": ActionType(Treatment.DATA_PARALLEL, PassKind.REDUCE_GRAD),
}
TORCH_NAME = {action.kind: name for name, action in ACTIONS.items() if action.kind is not None}
OVERLAP = "OVERLAP_F_B"

_TYPES = "|".join(sorted(ACTIONS, key=len, reverse=True))
_ACTION = re.compile(rf"^(\d+)({_TYPES})(\d*)$")
_OVERLAP = re.compile(rf"^\((.*)\){OVERLAP}$")


@dataclass(frozen=True)
class Action:
    """One PyTorch action at ``step`` (its cell) of ``rank``'s row."""

    rank: int
    step: int
    stage: int
    type: str
    microbatch: int | None

    def __str__(self) -> str:
        return f"{self.stage}{self.type}{'' if self.microbatch is None else self.microbatch}"

    def where(self) -> str:
        return f"rank {self.rank} step {self.step} ({self})"


def write_torch_csv(schedule: Schedule) -> str:
    """The CSV PyTorch's ``_load_csv`` reads (one row per rank): compute passes, and the data-parallel
    actions of a lowered schedule (``{stage}UNSHARD``, ``{stage}RESHARD``, ``{stage}REDUCE_GRAD``)."""
    if len(schedule.placements) > 1:
        raise ScheduleError(
            f"{schedule.name} runs {len(schedule.placements)} pipes (bidirectional); PyTorch's CSV holds one"
        )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    partner = {p: q for pair in schedule.overlapped for p, q in (pair, pair[::-1])}
    for order in schedule.orders:  # an all-to-all split out of a pass runs inside it there, as here
        cells, passes = [], [p for p in order if not spec(p.kind).part_of]
        for index, p in enumerate(passes):
            if index and partner.get(p) == passes[index - 1]:
                cells[-1] = f"({cells[-1]};{_cell(p)}){OVERLAP}"
            else:
                cells.append(_cell(p))
        writer.writerow(cells)
    return out.getvalue()


def _cell(p: Pass) -> str:
    if p.kind not in TORCH_NAME:
        raise ScheduleError(f"{p} has no PyTorch action (PyTorch's schedules keep one copy of each stage)")
    return f"{p.stage}{TORCH_NAME[p.kind]}{p.microbatch if p.kind.is_compute else ''}"


def read_torch_csv(text: str, name: str = "torch-csv") -> tuple[Schedule, list[str]]:
    """The schedule of a PyTorch CSV, compute-only or with communication, and notes on what was dropped."""
    rows = [_parse_row(rank, cells) for rank, cells in enumerate(csv.reader(io.StringIO(text)))]
    if not rows:
        raise ScheduleError(f"{name}: no rows; expected one row of actions per pipeline rank")
    compute = [[a for a in row if ACTIONS[a.type].treatment is Treatment.COMPUTE] for row in rows]
    for action in (a for row in compute for a in row):
        if action.microbatch is None:
            raise ScheduleError(f"{name}: {action.where()} names no microbatch")
    stage_rank = _stage_ranks(name, compute)
    placement = infer_placement(name, len(rows), stage_rank)
    kept = [[a for a in row if ACTIONS[a.type].treatment is not Treatment.P2P] for row in rows]
    orders = tuple(_passes(row) for row in kept)
    microbatches = 1 + max((a.microbatch for row in compute for a in row), default=-1)
    others = [a for row in rows for a in row if ACTIONS[a.type].treatment is not Treatment.COMPUTE]
    notes = _check_dropped(name, others, compute, placement)
    return Schedule(name, (placement,), microbatches, orders, overlapped=_pairs(compute)), notes


def _pairs(compute: list[list[Action]]) -> tuple[tuple[Pass, Pass], ...]:
    """The OVERLAP_F_B steps of one F and one backward (I or B), as (forward, backward); the others run in turn."""
    steps: dict[tuple[int, int], list[Action]] = {}
    for row in compute:
        for action in row:
            steps.setdefault((action.rank, action.step), []).append(action)
    pairs = []
    for actions in steps.values():
        kinds = sorted(ACTIONS[a.type].kind.value for a in actions)
        if kinds in (["B", "F"], ["BW", "F"]):
            found = sorted((Pass(ACTIONS[a.type].kind, a.stage, a.microbatch) for a in actions), key=_backward_last)
            pairs.append((found[0], found[1]))
    return tuple(pairs)


def _backward_last(p: Pass) -> bool:
    return p.kind is not PassKind.F


def _passes(row: list[Action]) -> tuple[Pass, ...]:
    """Our passes for a row: compute actions by microbatch, data-parallel ones by occurrence on their stage."""
    seen: dict[tuple[str, int], int] = {}
    found = []
    for a in row:
        kind = ACTIONS[a.type].kind
        if a.microbatch is None:
            occurrence = seen.get((a.type, a.stage), 0)
            seen[a.type, a.stage] = occurrence + 1
            found.append(Pass(kind, a.stage, occurrence))
        else:
            found.append(Pass(kind, a.stage, a.microbatch))
    return tuple(found)


def _parse_row(rank: int, cells: list[str]) -> list[Action]:
    actions = []
    for step, cell in enumerate(cells):
        text = cell.strip()
        if not text:
            continue
        overlap = _OVERLAP.match(text)
        parts = [part.strip() for part in overlap.group(1).split(";") if part.strip()] if overlap else [text]
        for part in parts:
            found = _ACTION.match(part)
            if found is None:
                raise ScheduleError(
                    f"rank {rank} step {step}: cannot read {cell!r}; expected PyTorch's [stage][type][microbatch], "
                    f"e.g. 2F0, 1I3, 0W3, 3B1, 1SEND_F0 or (0F1;3B0){OVERLAP}"
                )
            stage, kind, mb = found.groups()
            if overlap and ACTIONS[kind].treatment is not Treatment.COMPUTE:
                raise ScheduleError(f"rank {rank} step {step}: {OVERLAP} may hold compute actions only, got {part}")
            actions.append(Action(rank, step, int(stage), kind, int(mb) if mb else None))
    return actions


def _stage_ranks(name: str, compute: list[list[Action]]) -> dict[int, int]:
    stage_rank: dict[int, int] = {}
    for row in compute:
        for action in row:
            rank = stage_rank.setdefault(action.stage, action.rank)
            if rank != action.rank:
                raise ScheduleError(f"{name}: {action.where()}: stage {action.stage} also runs on rank {rank}")
    missing = sorted(set(range(1 + max(stage_rank, default=-1))) - set(stage_rank))
    if missing or not stage_rank:
        raise ScheduleError(f"{name}: no rank runs stage(s) {missing or [0]}; every stage needs its passes")
    return stage_rank


def infer_placement(name: str, pp: int, stage_rank: dict[int, int]) -> Placement:
    """Our placement for PyTorch's stage -> rank mapping: one stage per rank, "loop" or "v" style."""
    stages = len(stage_rank)
    counts = [sum(1 for rank in stage_rank.values() if rank == r) for r in range(pp)]
    if len(set(counts)) != 1:
        held = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ScheduleError(
            f"{name}: ranks hold different numbers of stages ({held}); "
            "megatron-zb places the same number of model chunks on every rank"
        )
    chunks = stages // pp
    candidates = [linear(pp)] if chunks == 1 else [interleaved(pp, chunks)]
    if chunks % 2 == 0:
        candidates.append(v_shape(pp, chunks))
    for placement in candidates:
        if all(placement.rank_of(stage) == rank for stage, rank in stage_rank.items()):
            return placement
    shown = ", ".join(f"{stage}: {stage_rank[stage]}" for stage in sorted(stage_rank))
    raise ScheduleError(
        f"{name}: the stage -> rank mapping {{{shown}}} is neither PyTorch's 'loop' style (stage s on rank s % {pp}) "
        f"nor its 'v' style (down the ranks and back up); megatron-zb places model chunks only those ways"
    )


def _check_dropped(name: str, others: list[Action], compute: list[list[Action]], placement: Placement) -> list[str]:
    """Refuse communication or data-parallel actions that contradict the compute order; notes on the rest."""
    for action in others:
        if not 0 <= action.stage < placement.num_stages or placement.rank_of(action.stage) != action.rank:
            raise ScheduleError(f"{name}: {action.where()}: stage {action.stage} does not run on rank {action.rank}")
    p2p = [a for a in others if ACTIONS[a.type].treatment is Treatment.P2P]
    dp = [a for a in others if ACTIONS[a.type].treatment is Treatment.DATA_PARALLEL]
    notes = []
    if p2p:
        _check_p2p(name, p2p, compute, placement)
        notes.append(
            f"{len(p2p)} SEND/RECV actions agree with the compute order and were dropped: megatron-zb derives its "
            "messages from the compute order"
        )
    if dp:
        _check_reduce_grad(name, [a for a in dp if a.type == "REDUCE_GRAD"], compute)
    return notes


def _compute_steps(compute: list[list[Action]]) -> dict[tuple[str, int, int], int]:
    """(role F or B, stage, microbatch) -> the step of the pass that plays it (BW plays B)."""
    steps = {}
    for row in compute:
        for a in row:
            if a.type != "W":
                steps["F" if a.type == "F" else "B", a.stage, a.microbatch] = a.step
    return steps


def _check_p2p(name: str, p2p: list[Action], compute: list[list[Action]], placement: Placement) -> None:
    """Every cross-rank edge has one send after its producer and one receive before its consumer."""
    steps = _compute_steps(compute)
    last = placement.num_stages - 1
    expected: dict[tuple[str, int, int], str] = {}
    for role, stage, mb in steps:
        peer = stage + 1 if role == "F" else stage - 1
        if 0 <= peer <= last and placement.rank_of(peer) != placement.rank_of(stage):
            expected[f"SEND_{role}", stage, mb] = f"{role} of stage {stage}"
            expected[f"RECV_{role}", peer, mb] = f"{role} of stage {peer}"
    seen: dict[tuple[str, int, int], Action] = {}
    for a in p2p:
        key = (a.type, a.stage, a.microbatch)
        if a.microbatch is None or key not in expected:
            raise ScheduleError(f"{name}: {a.where()} matches no cross-rank transfer of the compute order")
        if key in seen:
            raise ScheduleError(f"{name}: {a.where()} repeats {seen[key].where()}")
        seen[key] = a
        role = a.type[-1]
        at = steps[role, a.stage, a.microbatch]
        if a.type.startswith("SEND") and a.step <= at:
            raise ScheduleError(f"{name}: {a.where()} sends before its tensor is computed (step {at})")
        if a.type.startswith("RECV") and a.step >= at:
            raise ScheduleError(f"{name}: {a.where()} receives after the pass that needs it (step {at})")
    missing = sorted(set(expected) - set(seen))
    if missing:
        kind, stage, mb = missing[0]
        raise ScheduleError(
            f"{name}: the communication is incomplete: no {stage}{kind}{mb} on rank {placement.rank_of(stage)} "
            f"({len(missing)} missing); give every transfer, or a compute-only CSV"
        )


def _check_reduce_grad(name: str, reduce: list[Action], compute: list[list[Action]]) -> None:
    """A gradient reduction comes after the last backward of its stage on that rank."""
    last_backward: dict[int, int] = defaultdict(lambda: -1)
    for row in compute:
        for a in row:
            if a.type in ("W", "B"):
                last_backward[a.stage] = max(last_backward[a.stage], a.step)
    for a in reduce:
        if a.step <= last_backward[a.stage]:
            raise ScheduleError(
                f"{name}: {a.where()} reduces the gradients before the last backward of stage {a.stage} "
                f"(step {last_backward[a.stage]})"
            )
