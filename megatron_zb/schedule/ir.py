"""The schedule IR: compute passes on (stage, microbatch), ordered per rank.

A schedule holds compute passes only. Which rank and model chunk run a stage comes from
the placement; the communication between ranks is derived from the dependencies
(see ``comm.py``), never written by a generator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .placement import Placement


class ScheduleError(ValueError):
    """A schedule or a schedule request that cannot work; the message names the culprit."""


class PassKind(str, Enum):
    F = "F"  # forward
    B = "B"  # input-gradient backward (critical path)
    W = "W"  # weight-gradient backward (deferrable)
    BW = "BW"  # B and W fused, as in 1F1B

    def __str__(self) -> str:
        return self.value


_PASS_TEXT = re.compile(r"^(BW|F|B|W) s(\d+) mb(\d+)(?: d(\d+))?$")


@dataclass(frozen=True, order=True)
class Pass:
    """One compute pass. ``stage`` is the layer block in its pipe (0 .. pp*chunks-1)."""

    kind: PassKind
    stage: int
    microbatch: int
    pipe: int = 0  # which placement (direction) of the schedule; 0 unless bidirectional

    def __str__(self) -> str:
        suffix = f" d{self.pipe}" if self.pipe else ""
        return f"{self.kind.value} s{self.stage} mb{self.microbatch}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Pass:
        match = _PASS_TEXT.match(text.strip())
        if not match:
            raise ValueError(f"cannot parse pass {text!r}; expected e.g. 'F s0 mb3' or 'BW s1 mb0 d1'")
        kind, stage, mb, pipe = match.groups()
        return cls(PassKind(kind), int(stage), int(mb), int(pipe or 0))


def F(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.F, stage, microbatch, pipe)


def B(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.B, stage, microbatch, pipe)


def W(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.W, stage, microbatch, pipe)


def BW(stage: int, microbatch: int, pipe: int = 0) -> Pass:
    return Pass(PassKind.BW, stage, microbatch, pipe)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered compute passes over one or more placements (pipes)."""

    name: str
    placements: tuple[Placement, ...]
    microbatches: int
    orders: tuple[tuple[Pass, ...], ...]

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
