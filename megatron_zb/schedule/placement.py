"""Placements: which rank and model chunk hold each layer block of a pipe.

A pipe has ``pp * chunks`` blocks of equal size, numbered in layer order. Block ``b`` lies in
full stage ``b // chunks`` (a stage is 1/pp of the layers), which is how per-stage costs
apply to chunks. A bidirectional schedule uses two placements, the second mirrored.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Placement:
    kind: str
    pp: int
    chunks: int
    blocks: tuple[tuple[int, int], ...]  # block -> (rank, chunk)

    def __post_init__(self) -> None:
        expected = {(r, c) for r in range(self.pp) for c in range(self.chunk_base, self.chunk_base + self.chunks)}
        if len(self.blocks) != self.pp * self.chunks or set(self.blocks) != expected:
            raise ValueError(f"{self.kind} placement must use every (rank, chunk) exactly once: {self.blocks}")

    @property
    def chunk_base(self) -> int:
        return min(chunk for _, chunk in self.blocks)

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def rank_of(self, stage: int) -> int:
        return self.blocks[stage][0]

    def chunk_of(self, stage: int) -> int:
        return self.blocks[stage][1]

    def stage_of(self, rank: int, chunk: int) -> int:
        return self.blocks.index((rank, chunk))

    @property
    def megatron_builds(self) -> bool:
        """Whether megatron-core's own layer split builds it: block ``b`` on rank ``b % pp`` (linear, interleaved).

        Others (the V, mirrored pipes) are built by megatron-zb's layout, which also pads.
        """
        base = self.chunk_base
        return all((rank, chunk - base) == (b % self.pp, b // self.pp) for b, (rank, chunk) in enumerate(self.blocks))

    def full_stage(self, stage: int) -> int:
        """The 1/pp slice of the layers that this block belongs to (for per-stage costs)."""
        return stage // self.chunks


@cache  # placements are immutable: planners ask for the same one many times
def linear(pp: int) -> Placement:
    _check(pp, 1)
    return Placement("linear", pp, 1, tuple((r, 0) for r in range(pp)))


@cache
def interleaved(pp: int, chunks: int) -> Placement:
    """Looping placement: chunk c of rank r holds block c*pp + r."""
    _check(pp, chunks)
    return Placement("interleaved", pp, chunks, tuple((b % pp, b // pp) for b in range(pp * chunks)))


@cache
def v_shape(pp: int, chunks: int = 2) -> Placement:
    """Wave placement: even chunks go down the ranks, odd chunks come back up.

    With two chunks this is the V: rank r holds blocks r and 2*pp-1-r, so the first and the
    last block (embedding and loss) are both on rank 0.
    """
    _check(pp, chunks)
    if chunks % 2:
        raise ValueError(f"a V-shape placement needs an even number of chunks per rank, got {chunks}")
    blocks = []
    for b in range(pp * chunks):
        chunk, offset = divmod(b, pp)
        blocks.append((offset if chunk % 2 == 0 else pp - 1 - offset, chunk))
    return Placement("v", pp, chunks, tuple(blocks))


def mirrored(placement: Placement) -> Placement:
    """The same layer blocks travelling the other way (rank r <-> pp-1-r), on new chunk ids.

    Used for the second direction of a bidirectional schedule: its chunks follow the first
    placement's chunks on every rank.
    """
    pp, base = placement.pp, placement.chunks
    blocks = tuple((pp - 1 - rank, chunk + base) for rank, chunk in placement.blocks)
    return Placement(f"mirrored-{placement.kind}", pp, placement.chunks, blocks)


def _check(pp: int, chunks: int) -> None:
    if pp < 1:
        raise ValueError(f"pipeline size must be at least 1, got {pp}")
    if chunks < 1:
        raise ValueError(f"chunks per rank must be at least 1, got {chunks}")
