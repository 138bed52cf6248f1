"""What each kind of action is: where it runs, what it costs and frees, how it is drawn. Stated once.

Every pass of the core reads a kind's ``ActionSpec`` instead of keeping a table of its own: the
cost and memory model (``costs.py``), the dependency rule (``deps.py``), the simulator, the
validator and the renderers. Adding a kind means adding it to ``PassKind`` and here; beyond
that, only the lowering pass that inserts it and the runtime handler that executes it know it
by name.

Three streams: compute passes run one at a time, in order, on the rank's compute stream;
collectives (gathering weights, reducing gradients) run in order on a data-parallel stream of
their own, overlapping compute (issued when the rank reaches them, waited for by what needs
them); host actions (releasing gathered weights) take no time and block nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from .ir import PassKind

if TYPE_CHECKING:
    from .costs import CostModel


class Stream(str, Enum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    HOST = "host"


@dataclass(frozen=True)
class ActionSpec:
    kind: PassKind
    stream: Stream
    roles: tuple[str, ...]  # the roles it fulfils: B and W for BW, its own name for a per-stage action
    backward: bool  # part of the backward work: dropped by forward-only runs, never speculated on
    uses_weights: bool  # runs on the chunk's weights, so needs them gathered when the schedule shards them
    gathers: int  # +1 gathers the chunk's weights (opens a window), -1 releases them, 0 neither
    time: Callable[[CostModel, int], float]  # duration for a full stage (``stage`` = full-stage index)
    memory: Callable[[CostModel, int], float]  # memory it allocates (+) or frees (-), for a full stage
    grouped: bool  # a collective with the rank that holds the block's other copy (Schedule.shared)
    title: str  # legend text
    short: str  # one character, for narrow cells
    color: str  # SVG fill
    ansi: str  # terminal color

    @property
    def compute(self) -> bool:
        return self.stream is Stream.COMPUTE


def _none(costs: CostModel, stage: int) -> float:
    return 0.0


SPECS: dict[PassKind, ActionSpec] = {
    spec.kind: spec
    for spec in (
        ActionSpec(
            PassKind.F, Stream.COMPUTE, ("F",), False, True, 0,
            lambda c, s: c.t_f[s], lambda c, s: c.mem_f[s], False,
            "F forward", "F", "#5b8def", "\x1b[34m",
        ),
        ActionSpec(
            PassKind.B, Stream.COMPUTE, ("B",), True, True, 0,
            lambda c, s: c.t_b[s], lambda c, s: c.mem_b[s], False,
            "B input grad", "B", "#f2a541", "\x1b[33m",
        ),
        ActionSpec(  # W only adds to gradients: it needs none of the chunk's weights gathered
            PassKind.W, Stream.COMPUTE, ("W",), True, False, 0,
            lambda c, s: c.t_w[s], lambda c, s: c.mem_w[s], False,
            "W weight grad", "W", "#5cb85c", "\x1b[32m",
        ),
        ActionSpec(
            PassKind.BW, Stream.COMPUTE, ("B", "W"), True, True, 0,
            lambda c, s: c.t_b[s] + c.t_w[s], lambda c, s: -c.mem_f[s], False,
            "BW fused B+W", "X", "#b07cd8", "\x1b[35m",
        ),
        ActionSpec(
            PassKind.UNSHARD, Stream.COLLECTIVE, ("UNSHARD",), False, False, 1,
            lambda c, s: c.t_dp[s], lambda c, s: c.mem_param[s], False,
            "UNSHARD gather weights", "U", "#8fa3b8", "\x1b[36m",
        ),
        ActionSpec(
            PassKind.RESHARD, Stream.HOST, ("RESHARD",), False, False, -1,
            _none, lambda c, s: -c.mem_param[s], False,
            "RESHARD release weights", "r", "#c9d3dd", "\x1b[36m",
        ),
        ActionSpec(
            PassKind.REDUCE_GRAD, Stream.COLLECTIVE, ("REDUCE_GRAD",), True, False, 0,
            lambda c, s: c.t_dp[s], _none, False,
            "REDUCE_GRAD reduce grads", "R", "#d9534f", "\x1b[31m",
        ),
        ActionSpec(  # the two copies' gradients averaged on the pair of ranks that hold them
            PassKind.REPLICA_SYNC, Stream.COLLECTIVE, ("REPLICA_SYNC",), True, False, 0,
            lambda c, s: c.t_dp[s], _none, True,
            "REPLICA_SYNC sync replica grads", "S", "#e0a030", "\x1b[33m",
        ),
    )
}  # fmt: skip


def spec(kind: PassKind) -> ActionSpec:
    return SPECS[kind]
