"""The one dependency rule, used by the validator, the simulator and the comm derivation.

Dependencies are stated on *roles*: a BW pass plays both the B and the W role of its
(stage, microbatch), so a rule never has to know whether a schedule fused them. Compute
passes depend on each other through the model (``inputs``). The per-stage actions that
lowering adds depend on the rank's order (``order_inputs``): a pass on a chunk whose weights
the schedule gathers waits for the UNSHARD that opened its window, a REDUCE_GRAD for every W
of its stage, a REPLICA_SYNC for every W of both copies of its block, and a RESHARD for its
window's UNSHARD and a reduction still reading it. A part split out of a compute pass (the
all-to-all, ``ActionSpec.part_of``) comes before the rest of it: it needs what its pass needs, and
the pass waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .actions import spec
from .ir import Pass, PassKind, Schedule


class Role(NamedTuple):
    kind: str  # "F", "B", "W", or the name of a per-stage action
    pipe: int
    stage: int
    microbatch: int  # the occurrence, for a per-stage action

    def __str__(self) -> str:
        return str(Pass(PassKind(self.kind), self.stage, self.microbatch, self.pipe))


def roles(p: Pass) -> tuple[Role, ...]:
    """The roles a pass fulfils."""
    return tuple(Role(name, p.pipe, p.stage, p.microbatch) for name in spec(p.kind).roles)


def inputs(p: Pass, num_stages: int) -> tuple[Role, ...]:
    """The roles of other compute passes that must have finished before ``p`` may start.

    F needs the previous block's F; B needs its own F (the stashed activations) and the
    next block's B, or at the last block nothing more; W needs its own B. A part of a pass
    (A2A_F, A2A_B) needs what the pass needs. Per-stage actions have none here (see ``order_inputs``).
    """
    same = (p.pipe, p.stage, p.microbatch)
    if p.kind is PassKind.F:
        return (Role("F", p.pipe, p.stage - 1, p.microbatch),) if p.stage > 0 else ()
    if p.kind is PassKind.W:
        return (Role("B", *same),)
    if not p.kind.is_compute:
        part = spec(p.kind).part_of
        return inputs(Pass(PassKind(part), p.stage, p.microbatch, p.pipe), num_stages) if part else ()
    own = Role("F", *same)
    if p.stage == num_stages - 1:
        return (own,)
    return (own, Role("B", p.pipe, p.stage + 1, p.microbatch))


@dataclass(frozen=True)
class OrderInputs:
    """Per rank and position in its order: the inputs that come from the order itself."""

    inputs: tuple[tuple[tuple[Role, ...], ...], ...]
    sharded: tuple[tuple[int, ...], ...]  # per rank: positions of passes that run on released weights


def order_inputs(schedule: Schedule) -> OrderInputs:
    """Inputs stated by the rank's order: the gathers passes run on, the Ws a gradient reduction waits for."""
    if all(p.kind.is_compute for order in schedule.orders for p in order):  # nothing from the order
        return OrderInputs(tuple(((),) * len(order) for order in schedule.orders), ((),) * len(schedule.orders))
    all_inputs, all_sharded = [], []
    weights_of: dict[tuple[int, int], list[Role]] = {}  # (pipe, stage) -> W roles, for REDUCE_GRAD
    for order in schedule.orders:
        for p in order:
            weights_of.setdefault((p.pipe, p.stage), []).extend(r for r in roles(p) if r.kind == "W")
    synced = {(p.pipe, p.stage) for order in schedule.orders for p in order if spec(p.kind).grouped}
    parts = split_parts(schedule)
    for order in schedule.orders:
        gathered = {(p.pipe, p.stage) for p in order if spec(p.kind).gathers > 0}
        window: dict[tuple[int, int], Role] = {}  # open windows: (pipe, stage) -> the UNSHARD that opened it
        reducing: dict[tuple[int, int], Role] = {}  # a reduction inside the window reads the gathered gradients
        found, sharded = [], []
        for index, p in enumerate(order):
            key, kind = (p.pipe, p.stage), spec(p.kind)
            needed: tuple[Role, ...] = ()
            if kind.gathers > 0:
                window[key] = roles(p)[0]
            elif kind.gathers < 0:
                needed = tuple(role for role in (window.pop(key, None), reducing.pop(key, None)) if role is not None)
            elif kind.uses_weights and key in gathered:
                if key in window:
                    needed = (window[key],)
                else:
                    sharded.append(index)
            if p.kind is PassKind.REDUCE_GRAD:
                needed = tuple(weights_of.get(key, ()))
                if key in synced:  # a block kept twice is reduced once both copies are averaged
                    needed += (Role(PassKind.REPLICA_SYNC.value, *key, 0),)
                if key in window:
                    reducing[key] = roles(p)[0]
            elif kind.grouped:  # both copies' weight gradients, wherever they are computed
                other = schedule.replica(*key)
                needed = tuple(weights_of.get(key, ())) + tuple(weights_of.get(other, ()) if other else ())
            if parts and p.kind.is_compute:  # the parts split out of it run first
                needed += tuple(part for role in roles(p) for part in parts.get(role, ()))
            found.append(needed)
        all_inputs.append(tuple(found))
        all_sharded.append(tuple(sharded))
    return OrderInputs(tuple(all_inputs), tuple(all_sharded))


def split_parts(schedule: Schedule) -> dict[Role, tuple[Role, ...]]:
    """Role of a compute pass -> the roles of the parts lowering split out of it (its all-to-alls)."""
    parts: dict[Role, tuple[Role, ...]] = {}
    for order in schedule.orders:
        for p in order:
            part_of = spec(p.kind).part_of
            if part_of:
                whole = Role(part_of, p.pipe, p.stage, p.microbatch)
                parts[whole] = parts.get(whole, ()) + roles(p)
    return parts
