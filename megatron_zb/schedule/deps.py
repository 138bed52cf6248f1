"""The one dependency rule, used by the validator, the simulator and the comm derivation.

Dependencies are stated on *roles*: a BW pass plays both the B and the W role of its
(stage, microbatch), so a rule never has to know whether a schedule fused them.
"""

from __future__ import annotations

from typing import NamedTuple

from .ir import Pass, PassKind


class Role(NamedTuple):
    kind: str  # "F", "B" or "W"
    pipe: int
    stage: int
    microbatch: int

    def __str__(self) -> str:
        suffix = f" d{self.pipe}" if self.pipe else ""
        return f"{self.kind} s{self.stage} mb{self.microbatch}{suffix}"


def roles(p: Pass) -> tuple[Role, ...]:
    """The roles a pass fulfils."""
    if p.kind is PassKind.BW:
        return Role("B", p.pipe, p.stage, p.microbatch), Role("W", p.pipe, p.stage, p.microbatch)
    return (Role(p.kind.value, p.pipe, p.stage, p.microbatch),)


def inputs(p: Pass, num_stages: int) -> tuple[Role, ...]:
    """The roles that must have finished before ``p`` may start.

    F needs the previous block's F; B needs its own F (the stashed activations) and the
    next block's B, or at the last block nothing more; W needs its own B.
    """
    same = (p.pipe, p.stage, p.microbatch)
    if p.kind is PassKind.F:
        return (Role("F", p.pipe, p.stage - 1, p.microbatch),) if p.stage > 0 else ()
    if p.kind is PassKind.W:
        return (Role("B", *same),)
    own = Role("F", *same)
    if p.stage == num_stages - 1:
        return (own,)
    return (own, Role("B", p.pipe, p.stage + 1, p.microbatch))
