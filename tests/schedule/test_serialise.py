"""A schedule as plain data and back: every field, BitPipe's ``shared`` blocks included."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields, replace

import pytest

from megatron_zb.schedule import Schedule, ScheduleError, ScheduleSpec, build, names
from megatron_zb.schedule.lower import DataParallel, lower
from megatron_zb.schedule.serialise import schedule_from_data, schedule_to_data


def round_trip(schedule: Schedule) -> Schedule:
    """Through JSON text and through pickle, as torch.distributed's object collectives send it."""
    data = schedule_to_data(schedule)
    by_pickle = schedule_from_data(pickle.loads(pickle.dumps(data)))
    assert by_pickle == schedule_from_data(json.loads(json.dumps(data)))
    return by_pickle


@pytest.mark.parametrize("name", names())
def test_every_schedule_round_trips_whole(name):
    schedule = build(name, ScheduleSpec(4, 8))
    assert round_trip(schedule) == schedule
    lowered = lower(schedule, DataParallel(gather="windows"))  # per-stage actions too
    assert round_trip(lowered) == lowered


@pytest.mark.parametrize("name", ["bitpipe", "bitpipe-zb"])
def test_shared_blocks_survive(name):
    schedule = build(name, ScheduleSpec(2, 4))
    assert schedule.shared
    copy = round_trip(schedule)
    assert copy.shared == schedule.shared
    assert copy.placements[1].kind.startswith("mirrored-")
    syncs = [str(p) for order in lower(copy, DataParallel()).orders for p in order if p.kind.value == "REPLICA_SYNC"]
    assert len(syncs) == 2 * len(schedule.shared)  # both holders of every shared block


def test_the_data_names_every_field_of_schedule():
    data = schedule_to_data(build("zb-h1", ScheduleSpec(2, 4)))
    assert set(data) == {field.name for field in fields(Schedule)}


def test_a_missing_or_unknown_field_is_refused():
    data = schedule_to_data(build("bitpipe", ScheduleSpec(2, 4)))
    del data["shared"]
    data["extra"] = 1
    with pytest.raises(ScheduleError, match=r"missing field\(s\) \['shared'\], unknown field\(s\) \['extra'\]"):
        schedule_from_data(data)


def test_overlapped_pairs_survive_and_older_data_has_none():
    s = build("zb-1p", ScheduleSpec(2, 4))
    order = s.orders[0]
    i = next(i for i in range(len(order) - 1) if {order[i].kind.value, order[i + 1].kind.value} == {"F", "B"})
    pair = (order[i], order[i + 1]) if order[i].kind.value == "F" else (order[i + 1], order[i])
    paired = replace(s, overlapped=(pair,))
    assert schedule_from_data(schedule_to_data(paired)) == paired
    older = schedule_to_data(s)
    del older["overlapped"]
    assert schedule_from_data(older) == s
