"""What a planner returns: per-rank orders with their stage span, makespan and peak memory.

Planners run many candidates and keep one, so they record each pass as an integer code
(kind, stage, microbatch) and only the chosen orders become ``Pass`` objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..ir import Pass, PassKind

KINDS = (PassKind.F, PassKind.B, PassKind.W, PassKind.BW)
CODE = {kind: index for index, kind in enumerate(KINDS)}
F_CODE, B_CODE, W_CODE = 0, 1, 2


def encode(kind: int, stage: int, microbatch: int, stages: int, microbatches: int) -> int:
    return (kind * stages + stage) * microbatches + microbatch


@dataclass(frozen=True)
class Result:
    codes: list[list[int]]  # per rank, ``encode``d passes
    stages: int
    microbatches: int
    stage_span: float
    makespan: float
    peak: float
    _decoded: list = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of_passes(
        cls, orders: Sequence[Sequence[Pass]], stages: int, microbatches: int, span: float, makespan: float, peak: float
    ) -> Result:
        codes = [[encode(CODE[x.kind], x.stage, x.microbatch, stages, microbatches) for x in order] for order in orders]
        return cls(codes, stages, microbatches, span, makespan, peak)

    @property
    def orders(self) -> list[list[Pass]]:
        if not self._decoded:
            n, m = self.stages, self.microbatches
            self._decoded.append(
                [[Pass(KINDS[code // (n * m)], code // m % n, code % m) for code in order] for order in self.codes]
            )
        return self._decoded[0]

    def score(self) -> tuple[float, float, float]:
        return (round(self.stage_span, 9), round(self.makespan, 9), round(self.peak, 9))
