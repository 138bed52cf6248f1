"""The schedule IR: actions on (stage, microbatch), ordered per rank.

Generators emit compute passes only (F, B, W, BW). Lowering passes (``lower.py``) add the
data-parallel actions of a chunk: gather its weights (UNSHARD), release them (RESHARD), reduce
its gradients (REDUCE_GRAD); for those, ``microbatch`` counts the action's occurrences on its
stage (0 for the first); REPLICA_SYNC (average a block's gradients with its other copy, on the
rank that holds it) where the schedule keeps two copies of a block. Where the model has MoE
layers, lowering also splits the expert-parallel all-to-all out of the passes that run it, as
actions on (stage, microbatch) like the passes: A2A_F (dispatch and combine of the block's MoE
layers) before its F, A2A_B (their backward) before its B or BW. What each kind needs, costs and
frees is stated once, in ``actions.py``. Which rank and model chunk run a stage comes from the placement; point-to-point
communication is derived from the dependencies (see ``comm.py``), never written by a generator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from .placement import Placement


class ScheduleError(ValueError):
    """A schedule or a schedule request that cannot work; the message names the culprit."""


class PassKind(str, Enum):
    F = "F"  # forward
    B = "B"  # input-gradient backward (critical path)
    W = "W"  # weight-gradient backward (deferrable)
    BW = "BW"  # B and W fused, as in 1F1B
    UNSHARD = "UNSHARD"  # gather the chunk's weights (data-parallel collective)
    RESHARD = "RESHARD"  # release the gathered weights
    REDUCE_GRAD = "REDUCE_GRAD"  # reduce the chunk's gradients (data-parallel collective)
    REPLICA_SYNC = "REPLICA_SYNC"  # average the gradients of a block's two copies (with the rank holding the other)
    A2A_F = "A2A_F"  # the expert-parallel all-to-alls of an F (dispatch + combine of every MoE layer of the block)
    A2A_B = "A2A_B"  # their backward, in the B (or BW) of the same microbatch

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """A compute pass on (stage, microbatch); the others are per-stage actions added by lowering."""
        return self in _COMPUTE

    @property
    def per_microbatch(self) -> bool:
        """An action on (stage, microbatch): a compute pass or a part split out of one (A2A_F, A2A_B)."""
        return self in _PER_MICROBATCH


_COMPUTE = frozenset({PassKind.F, PassKind.B, PassKind.W, PassKind.BW})
_PER_MICROBATCH = _COMPUTE | {PassKind.A2A_F, PassKind.A2A_B}
_new = object.__new__
_PASS_TEXT = re.compile(r"^(BW|F|B|W|A2A_F|A2A_B) s(\d+) mb(\d+)(?: d(\d+))?$")
_ACTION_TEXT = re.compile(r"^(UNSHARD|RESHARD|REDUCE_GRAD|REPLICA_SYNC) s(\d+)(?: #(\d+))?(?: d(\d+))?$")


@dataclass(frozen=True, order=True)
class Pass:
    """One action. ``stage`` is the layer block in its pipe (0 .. pp*chunks-1); ``microbatch`` is
    the microbatch of a compute pass (or of a part of one), and the occurrence (0, 1, ...) of a
    per-stage action."""

    kind: PassKind
    stage: int
    microbatch: int
    pipe: int = 0  # which placement (direction) of the schedule; 0 unless bidirectional

    def __str__(self) -> str:
        suffix = f" d{self.pipe}" if self.pipe else ""
        if not self.kind.per_microbatch:
            occurrence = f" #{self.microbatch}" if self.microbatch else ""
            return f"{self.kind.value} s{self.stage}{occurrence}{suffix}"
        return f"{self.kind.value} s{self.stage} mb{self.microbatch}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Pass:
        match = _PASS_TEXT.match(text.strip()) or _ACTION_TEXT.match(text.strip())
        if not match:
            raise ValueError(
                f"cannot parse pass {text!r}; expected e.g. 'F s0 mb3', 'BW s1 mb0 d1', 'REDUCE_GRAD s2' "
                "or 'UNSHARD s1 #1'"
            )
        kind, stage, mb, pipe = match.groups()
        return cls(PassKind(kind), int(stage), int(mb or 0), int(pipe or 0))


def made_pass(kind: PassKind, stage: int, microbatch: int, pipe: int = 0) -> Pass:
    """``Pass(kind, stage, microbatch, pipe)`` without the frozen dataclass's ``__init__``, which sets each
    field through ``object.__setattr__``: half the time, for planners that decode 10^5 passes at once.
    The same value (equal, hashed and ordered alike)."""
    made = _new(Pass)
    fields = made.__dict__
    fields["kind"], fields["stage"], fields["microbatch"], fields["pipe"] = kind, stage, microbatch, pipe
    return made


def F(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.F, stage, microbatch, pipe)


def B(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.B, stage, microbatch, pipe)


def W(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.W, stage, microbatch, pipe)


def BW(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.BW, stage, microbatch, pipe)


Block = tuple[int, int]  # (pipe, stage)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered compute passes over one or more placements (pipes).

    ``shared`` pairs blocks of different pipes that hold the same weights (BitPipe's mirrored
    pipes): the two copies start equal and their gradients are averaged before every step, so
    they stay equal (lowering adds the REPLICA_SYNC that does it).

    ``overlapped`` pairs an F with a B or BW of another microbatch (or stage) on the same rank,
    next to each other in its order (either first): DualPipe's overlapped F&B. The two run as one
    step, each one's expert-parallel all-to-all behind the other's compute; both take their inputs
    before the step and send their outputs after it.
    """

    name: str
    placements: tuple[Placement, ...]
    microbatches: int
    orders: tuple[tuple[Pass, ...], ...]
    shared: tuple[tuple[Block, Block], ...] = ()
    overlapped: tuple[tuple[Pass, Pass], ...] = ()  # (forward, backward) run as one step

    def __post_init__(self) -> None:
        pps = {placement.pp for placement in self.placements}
        if len(pps) != 1:
            raise ScheduleError(f"{self.name}: all placements must span the same ranks, got pp {sorted(pps)}")
        if len(self.orders) != self.pp:
            raise ScheduleError(f"{self.name}: {len(self.orders)} rank orders for pp={self.pp}")
        seen: dict[tuple[int, int], int] = {}
        for pipe, placement in enumerate(self.placements):
            for rank, chunk in placement.blocks:
                if (rank, chunk) in seen:
                    raise ScheduleError(
                        f"{self.name}: rank {rank} chunk {chunk} is used by pipes {seen[rank, chunk]} and {pipe}"
                    )
                seen[rank, chunk] = pipe
        copies: dict[Block, Block] = {}
        for pair in self.shared:
            for block, other in (pair, pair[::-1]):
                pipe, stage = block
                if not (0 <= pipe < len(self.placements) and 0 <= stage < self.placements[pipe].num_stages):
                    raise ScheduleError(f"{self.name}: shared block {block} is not a (pipe, stage) of the schedule")
                if block == other or copies.setdefault(block, other) != other:
                    raise ScheduleError(f"{self.name}: block {block} shares weights with more than one other block")
        if self.overlapped:
            self._check_overlapped()

    def _check_overlapped(self) -> None:
        where = {p: (rank, i) for rank, order in enumerate(self.orders) for i, p in enumerate(order)}
        taken: set[Pass] = set()
        for forward, backward in self.overlapped:
            what = f"{self.name}: overlapped pair ({forward}, {backward})"
            if forward.kind is not PassKind.F or backward.kind not in (PassKind.B, PassKind.BW):
                raise ScheduleError(f"{what}: a pair is an F and a B or BW")
            if forward in taken or backward in taken:
                raise ScheduleError(f"{what}: a pass is in more than one pair")
            taken.update((forward, backward))
            if forward not in where or backward not in where:
                raise ScheduleError(f"{what}: both passes must be in the orders")
            (rank, i), (other, j) = where[forward], where[backward]
            if rank != other or abs(i - j) != 1:
                raise ScheduleError(
                    f"{what}: the two must be next to each other in one rank's order "
                    f"(rank {rank} pass {i}, rank {other} pass {j})"
                )

    def partner(self, p: Pass) -> Pass | None:
        """The pass ``p`` runs beside in an overlapped pair, if any."""
        return self._partners.get(p) if self.overlapped else None

    @cached_property
    def _partners(self) -> dict[Pass, Pass]:
        """Each paired pass's partner: ``partner`` is asked for every pass of every rank (comm, the executor)."""
        return {p: q for forward, backward in self.overlapped for p, q in ((forward, backward), (backward, forward))}

    def replica(self, pipe: int, stage: int) -> Block | None:
        """The other copy of (pipe, stage)'s weights, if the schedule keeps one."""
        for first, second in self.shared:
            if first == (pipe, stage):
                return second
            if second == (pipe, stage):
                return first
        return None

    @property
    def pp(self) -> int:
        return self.placements[0].pp

    @property
    def placement(self) -> Placement:
        return self.placements[0]

    @property
    def chunks(self) -> int:
        """Model chunks per rank, over all pipes."""
        return sum(placement.chunks for placement in self.placements)

    def num_stages(self, pipe: int = 0) -> int:
        return self.placements[pipe].num_stages

    def rank_of(self, p: Pass) -> int:
        return self.placements[p.pipe].rank_of(p.stage)

    def chunk_of(self, p: Pass) -> int:
        return self.placements[p.pipe].chunk_of(p.stage)

    def to_text(self) -> str:
        """One line per rank; ``parse_orders`` reads it back (golden files, hand-made tests)."""
        return "\n".join(f"rank {r}: " + ", ".join(map(str, order)) for r, order in enumerate(self.orders))


def parse_orders(text: str) -> tuple[tuple[Pass, ...], ...]:
    """Read the ``rank N: pass, pass, ...`` lines written by ``Schedule.to_text``."""
    orders = []
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        head, _, body = line.partition(":")
        if head.split() != ["rank", str(len(orders))]:
            raise ValueError(f"expected 'rank {len(orders)}: ...', got {line!r}")
        orders.append(tuple(Pass.parse(item) for item in body.split(",") if item.strip()))
    return tuple(orders)
