"""How far each rank may run into an iteration before the previous optimizer step is validated.

With optimizer post-validation a rank steps speculatively and starts the next iteration while
the full grad statistics travel back along the pipeline. The passes it may run meanwhile are
a prefix of its order: its forwards before its first backward, cut further where one of them
needs a message that another rank sends only after its own prefix. This closure makes the
prefixes a consistent cut: when a step must be redone, every rank discards exactly its prefix,
every message sent inside the prefixes is drained, and no rank waits on another's validation
before reaching its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import spec
from .comm import messages
from .deps import inputs
from .execute import producers
from .ir import Schedule


@dataclass(frozen=True)
class Speculation:
    prefix: tuple[int, ...]  # per rank: passes that may run before the previous step is validated
    sent_in_prefix: tuple[dict[int, int], ...]  # per receiving rank: sender -> messages sent within its prefix


def speculation(schedule: Schedule) -> Speculation:
    """The consistent cut of ``schedule``: per rank, the passes before its first B, closed over messages."""
    orders = schedule.orders
    prefix = [_first_backward(order) for order in orders]
    position = {(rank, p): i for rank, order in enumerate(orders) for i, p in enumerate(order)}
    made_by = producers(schedule)
    changed = True
    while changed:
        changed = False
        for rank, order in enumerate(orders):
            for index in range(prefix[rank]):
                p = order[index]
                late = any(
                    source != rank and position[source, producer] >= prefix[source]
                    for source, producer in (made_by[role] for role in inputs(p, schedule.num_stages(p.pipe)))
                )
                if late:
                    prefix[rank], changed = index, True
                    break
    sent: list[dict[int, int]] = [{} for _ in orders]
    for message in messages(schedule):
        if position[message.src, message.producer] < prefix[message.src]:
            sent[message.dst][message.src] = sent[message.dst].get(message.src, 0) + 1
    return Speculation(tuple(prefix), tuple(sent))


def _first_backward(order) -> int:
    for index, p in enumerate(order):
        if spec(p.kind).backward:
            return index
    return len(order)
