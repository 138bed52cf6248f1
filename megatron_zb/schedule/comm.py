"""Communication derived from the dependencies: who sends what to whom, and in which order.

A message exists for every input that is produced on another rank (activations forward,
input gradients backward). Inputs produced on the same rank, such as the V turn between
two chunks of one rank, are handed over locally and need none. The parts split out of a pass
(its all-to-all) wait for the pass's inputs but receive nothing: the pass does. Between a pair of ranks,
messages are matched in the sender's order (NCCL semantics), so each carries its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .deps import inputs
from .execute import producers
from .ir import Pass, Schedule


class CommOp(str, Enum):
    SEND = "SEND"
    RECV = "RECV"


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    producer: Pass
    consumer: Pass
    seq: int  # position among the messages from src to dst, in send order

    @property
    def payload(self) -> str:
        return "activation" if self.consumer.kind.value == "F" else "gradient"

    def __str__(self) -> str:
        return f"{self.payload} {self.producer} (rank {self.src}) -> {self.consumer} (rank {self.dst}) #{self.seq}"


@dataclass(frozen=True)
class CommStep:
    """A send or receive placed in a rank's program; sends follow their producer, receives
    are posted before their consumer, earlier ones of the same sender first."""

    op: CommOp
    peer: int
    message: Message

    def __str__(self) -> str:
        m = self.message
        if self.op is CommOp.SEND:
            return f"SEND {m.payload} of {m.producer} to rank {self.peer}"
        return f"RECV {m.payload} for {m.consumer} from rank {self.peer}"


def messages(schedule: Schedule) -> tuple[Message, ...]:
    """Every cross-rank transfer, in the order the senders issue them (rank by rank)."""
    producer = producers(schedule)
    found = []
    for dst, order in enumerate(schedule.orders):
        for consumer in order:
            if not consumer.kind.is_compute:
                continue  # per-stage actions need no tensor of another rank; a pass's parts leave it to the pass
            for role in inputs(consumer, schedule.num_stages(consumer.pipe)):
                src, made_by = producer[role]
                if src != dst:
                    found.append((src, dst, made_by, consumer))
    position = {(rank, p): i for rank, order in enumerate(schedule.orders) for i, p in enumerate(order)}
    found.sort(key=lambda item: (item[0], position[item[0], item[2]], item[1]))
    counts: dict[tuple[int, int], int] = {}
    result = []
    for src, dst, made_by, consumer in found:
        seq = counts.get((src, dst), 0)
        counts[src, dst] = seq + 1
        result.append(Message(src, dst, made_by, consumer, seq))
    return tuple(result)


def program(schedule: Schedule) -> tuple[tuple[Pass | CommStep, ...], ...]:
    """Per-rank compute passes with their sends and receives placed (for the runtime).

    The two passes of an overlapped pair are one step: the receives of both are posted before the
    first, the sends of both follow the second.
    """
    outgoing: dict[tuple[int, Pass], list[Message]] = {}
    incoming: dict[tuple[int, Pass], list[Message]] = {}
    channel: dict[tuple[int, int], list[Message]] = {}
    for message in messages(schedule):
        outgoing.setdefault((message.src, message.producer), []).append(message)
        incoming.setdefault((message.dst, message.consumer), []).append(message)
        channel.setdefault((message.src, message.dst), []).append(message)
    programs = []
    paired = {p for pair in schedule.overlapped for p in pair}
    for rank, order in enumerate(schedule.orders):
        posted: dict[int, int] = {}  # sender -> receives posted so far
        steps: list[Pass | CommStep] = []
        for index, p in enumerate(order):
            if p in paired and index + 1 < len(order) and order[index + 1] == schedule.partner(p):
                first = True
                needs = incoming.get((rank, p), []) + incoming.get((rank, order[index + 1]), [])
            else:
                first = False
                needs = [] if p in paired else incoming.get((rank, p), [])
            for needed in sorted(needs, key=lambda m: (m.src, m.seq)):
                queue = channel[needed.src, rank]
                while posted.get(needed.src, 0) <= needed.seq:
                    early = queue[posted.get(needed.src, 0)]
                    steps.append(CommStep(CommOp.RECV, needed.src, early))
                    posted[needed.src] = early.seq + 1
            steps.append(p)
            if first:
                continue  # its sends go after its partner's
            sent = [*outgoing.get((rank, order[index - 1]), ())] if p in paired else []
            steps += [CommStep(CommOp.SEND, m.dst, m) for m in (*sent, *outgoing.get((rank, p), ()))]
        programs.append(tuple(steps))
    return tuple(programs)


def volume(schedule: Schedule) -> int:
    """Number of cross-rank transfers per iteration (each one microbatch's boundary tensor)."""
    return len(messages(schedule))
