"""The consistent cut post-validation runs to: every rank's forwards before its first backward, closed."""

import pytest

from megatron_zb.schedule import PassKind, ScheduleSpec, build, names
from megatron_zb.schedule.comm import messages
from megatron_zb.schedule.deps import inputs
from megatron_zb.schedule.execute import producers
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.speculation import speculation


def test_one_f_one_b_prefix_is_the_warm_up() -> None:
    """Rank r of 1F1B runs p-r forwards before its first backward, and sends the next rank one per forward."""
    found = speculation(build("1f1b", ScheduleSpec(4, 8)))
    assert found.prefix == (4, 3, 2, 1)
    assert found.sent_in_prefix == ({}, {0: 4}, {1: 3}, {2: 2})


def test_v_prefix_receives_from_both_neighbours() -> None:
    found = speculation(build("zb-v", ScheduleSpec(4, 8)))
    assert found.prefix == (8, 8, 8, 8)
    assert found.sent_in_prefix[1] == {0: 7, 2: 3}  # chunk-0 activations from rank 0, chunk-1 ones from rank 2


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 13)])
def test_prefixes_are_closed_forwards(name: str, pp: int, m: int) -> None:
    """Only forwards; none needs anything another rank produces after its own prefix; messages counted exactly."""
    try:
        schedule = build(name, ScheduleSpec(pp, m, memory_limit=2 * pp if name in ("zb-auto", "auto") else None))
    except ScheduleError as error:  # a generator refusing a setting names itself and what it needs
        if not str(error).startswith(f"{name} needs "):
            raise
        pytest.skip(str(error))  # such refusals are covered by the schedule's own tests
    found = speculation(schedule)
    made_by = producers(schedule)
    position = {(r, p): i for r, order in enumerate(schedule.orders) for i, p in enumerate(order)}
    for rank, order in enumerate(schedule.orders):
        prefix = order[: found.prefix[rank]]
        assert all(p.kind is PassKind.F for p in prefix)
        for p in prefix:
            for role in inputs(p, schedule.num_stages(p.pipe)):
                source, producer = made_by[role]
                assert source == rank or position[source, producer] < found.prefix[source], (rank, p, producer)
    counted: dict = {}
    for message in messages(schedule):
        if position[message.src, message.producer] < found.prefix[message.src]:
            counted.setdefault(message.dst, {}).setdefault(message.src, []).append(message.seq)
    for dst, senders in counted.items():
        for src, seqs in senders.items():
            assert seqs == list(range(found.sent_in_prefix[dst][src])), "the prefix's messages lead each channel"
