"""A schedule as plain data (dicts, lists, strings, ints) and back: every field of ``Schedule``.

What one rank plans and the others run must arrive whole. Sending the orders alone (the text
form) loses the placements' kinds and ``shared``, the blocks kept twice, without which lowering
adds no REPLICA_SYNC and BitPipe's two copies of a block drift apart. The data is what
``json.dumps`` and ``pickle`` (``torch.distributed.broadcast_object_list``) both carry.
"""

from __future__ import annotations

from dataclasses import fields

from .ir import Pass, PassKind, Schedule, ScheduleError
from .placement import Placement

FIELDS = frozenset(field.name for field in fields(Schedule))
OPTIONAL = frozenset({"overlapped"})  # written by later versions; older files hold none


def _pass_data(p: Pass) -> list:
    return [p.kind.value, p.stage, p.microbatch, p.pipe]


def _pass(data: list) -> Pass:
    kind, stage, microbatch, pipe = data
    return Pass(PassKind(kind), stage, microbatch, pipe)


def schedule_to_data(schedule: Schedule) -> dict:
    """``schedule`` as plain data; ``schedule_from_data`` gives back an equal schedule."""
    data = {
        "name": schedule.name,
        "placements": [
            {"kind": p.kind, "pp": p.pp, "chunks": p.chunks, "blocks": [list(block) for block in p.blocks]}
            for p in schedule.placements
        ],
        "microbatches": schedule.microbatches,
        "orders": [[_pass_data(p) for p in order] for order in schedule.orders],
        "shared": [[list(first), list(second)] for first, second in schedule.shared],
        "overlapped": [[_pass_data(p) for p in pair] for pair in schedule.overlapped],
    }
    if data.keys() != FIELDS:  # a field added to Schedule must be carried here too, not dropped in transit
        raise ScheduleError(f"schedule_to_data does not carry Schedule field(s) {sorted(FIELDS - data.keys())}")
    return data


def schedule_from_data(data: dict) -> Schedule:
    """The schedule ``schedule_to_data`` wrote; ScheduleError when a field is missing or unknown."""
    if not FIELDS - OPTIONAL <= data.keys() <= FIELDS:
        missing, unknown = sorted(FIELDS - OPTIONAL - data.keys()), sorted(data.keys() - FIELDS)
        raise ScheduleError(f"not a serialised schedule: missing field(s) {missing}, unknown field(s) {unknown}")
    placements = tuple(
        Placement(p["kind"], p["pp"], p["chunks"], tuple(tuple(block) for block in p["blocks"]))
        for p in data["placements"]
    )
    orders = tuple(tuple(map(_pass, order)) for order in data["orders"])
    shared = tuple((tuple(first), tuple(second)) for first, second in data["shared"])
    overlapped = tuple((_pass(forward), _pass(backward)) for forward, backward in data.get("overlapped", ()))
    return Schedule(data["name"], placements, data["microbatches"], orders, shared, overlapped)
