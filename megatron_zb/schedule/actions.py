"""What each kind of action is: where it runs, what it costs and frees, how it is drawn. Stated once.

Every pass of the core reads a kind's ``ActionSpec`` instead of keeping a table of its own: the
cost and memory model (``costs.py``), the dependency rule (``deps.py``), the simulator, the
validator and the renderers. Adding a kind means adding it to ``PassKind`` and here; beyond
that, only the lowering pass that inserts it and the runtime handler that executes it know it
by name.

Four streams: compute passes run one at a time, in order, on the rank's compute stream;
collectives (gathering weights, reducing gradients) run in order on a data-parallel stream of
their own, overlapping compute (issued when the rank reaches them, waited for by what needs
them); host actions (releasing gathered weights) take no time and block nothing; the
expert-parallel all-to-all has a stream of its own that blocks the compute stream while it runs,
as megatron-core's token dispatcher waits for it. Its actions are parts of a compute pass
(``part_of``): their time is inside that pass's time, which lowering splits in two (``lower.py``).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from enum import Enum

from .ir import PassKind


class Stream(str, Enum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    HOST = "host"
    EXPERT = "expert"  # the expert-parallel all-to-all: synchronous, the compute stream waits for it


@dataclass(frozen=True)
class ActionSpec:
    """One kind of action. Costs name ``CostModel`` fields (per full stage) instead of reading them, so
    that this table needs nothing of ``costs.py``, which reads it. Every field but ``kind`` is given by
    name; the defaults are a compute pass that waits for nothing special and costs nothing."""

    kind: PassKind
    _: KW_ONLY
    roles: tuple[str, ...]  # the roles it fulfils: B and W for BW, its own name for a per-stage action
    title: str  # legend text
    short: str  # one character, for narrow cells
    color: str  # SVG fill
    ansi: str  # terminal color
    stream: Stream = Stream.COMPUTE
    backward: bool = False  # part of the backward work: dropped by forward-only runs, never speculated on
    uses_weights: bool = False  # runs on the chunk's weights, so needs them gathered when the schedule shards them
    gathers: int = 0  # +1 gathers the chunk's weights (opens a window), -1 releases them, 0 neither
    time: tuple[str, ...] = ()  # the CostModel times whose sum is its duration (none: it takes no time)
    own_time: str = ""  # a CostModel time measured for this kind itself that, where given, replaces ``time``'s sum
    memory: str = ""  # the CostModel memory delta it applies (allocates +, frees -), if any
    frees: str = ""  # the CostModel memory it releases (what another kind allocated), if any
    grouped: bool = False  # a collective with the rank that holds the block's other copy (Schedule.shared)
    part_of: str = ""  # the role of the compute pass (same stage and microbatch) whose time includes this one's

    @property
    def compute(self) -> bool:
        return self.stream is Stream.COMPUTE

    @property
    def blocks_compute(self) -> bool:
        """Whether the rank's compute stream is busy while it runs (a compute pass, an all-to-all)."""
        return self.stream in (Stream.COMPUTE, Stream.EXPERT)


SPECS: dict[PassKind, ActionSpec] = {
    spec.kind: spec
    for spec in (
        ActionSpec(
            PassKind.F, roles=("F",), uses_weights=True,
            time=("t_f",), memory="mem_f",
            title="F forward", short="F", color="#5b8def", ansi="\x1b[34m",
        ),
        ActionSpec(
            PassKind.B, roles=("B",), backward=True, uses_weights=True,
            time=("t_b",), memory="mem_b",
            title="B input grad", short="B", color="#f2a541", ansi="\x1b[33m",
        ),
        ActionSpec(  # W only adds to gradients: it needs none of the chunk's weights gathered
            PassKind.W, roles=("W",), backward=True,
            time=("t_w",), memory="mem_w",
            title="W weight grad", short="W", color="#5cb85c", ansi="\x1b[32m",
        ),
        ActionSpec(
            PassKind.BW, roles=("B", "W"), backward=True, uses_weights=True,
            time=("t_b", "t_w"), own_time="t_bw", frees="mem_f",
            title="BW fused B+W", short="X", color="#b07cd8", ansi="\x1b[35m",
        ),
        ActionSpec(
            PassKind.UNSHARD, roles=("UNSHARD",), stream=Stream.COLLECTIVE, gathers=1,
            time=("t_dp",), memory="mem_param",
            title="UNSHARD gather weights", short="U", color="#8fa3b8", ansi="\x1b[36m",
        ),
        ActionSpec(
            PassKind.RESHARD, roles=("RESHARD",), stream=Stream.HOST, gathers=-1,
            frees="mem_param",
            title="RESHARD release weights", short="r", color="#c9d3dd", ansi="\x1b[36m",
        ),
        ActionSpec(
            PassKind.REDUCE_GRAD, roles=("REDUCE_GRAD",), stream=Stream.COLLECTIVE, backward=True,
            time=("t_dp",),
            title="REDUCE_GRAD reduce grads", short="R", color="#d9534f", ansi="\x1b[31m",
        ),
        ActionSpec(  # the two copies' gradients averaged on the pair of ranks that hold them
            PassKind.REPLICA_SYNC, roles=("REPLICA_SYNC",), stream=Stream.COLLECTIVE, backward=True, grouped=True,
            time=("t_dp",),
            title="REPLICA_SYNC sync replica grads", short="S", color="#e0a030", ansi="\x1b[33m",
        ),
        ActionSpec(  # dispatch + combine of the block's MoE layers, split out of its F
            PassKind.A2A_F, roles=("A2A_F",), stream=Stream.EXPERT, uses_weights=True, part_of="F",
            time=("t_a2a",),
            title="A2A_F all-to-all fwd", short="a", color="#17a2b8", ansi="\x1b[96m",
        ),
        ActionSpec(  # their backward, split out of the B (or BW)
            PassKind.A2A_B, roles=("A2A_B",), stream=Stream.EXPERT, backward=True, uses_weights=True, part_of="B",
            time=("t_a2a_b",),
            title="A2A_B all-to-all bwd", short="A", color="#0e6b7a", ansi="\x1b[36m",
        ),
    )
}  # fmt: skip


# The role of a compute pass -> the kind split out of a pass that plays it (its all-to-all).
PARTS: dict[str, PassKind] = {action.part_of: kind for kind, action in SPECS.items() if action.part_of}


def spec(kind: PassKind) -> ActionSpec:
    return SPECS[kind]
