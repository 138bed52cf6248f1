"""Derived communication: one message per cross-rank input, local hand-over on the V turn."""

import pytest

from megatron_zb.schedule.comm import CommOp, CommStep, messages, program, volume
from megatron_zb.schedule.ir import Pass, Schedule, ScheduleError, parse_orders
from megatron_zb.schedule.placement import v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, names
from megatron_zb.schedule.validate import validate

# p=2 V: rank 0 holds blocks 0 and 3, rank 1 blocks 1 and 2. Rank 0 sends the gradient of mb0
# before the activation of mb1, rank 1 needs them the other way round.
V_2x2 = """
rank 0: F s0 mb0, F s3 mb0, BW s3 mb0, F s0 mb1, F s3 mb1, BW s3 mb1, BW s0 mb0, BW s0 mb1
rank 1: F s1 mb0, F s2 mb0, F s1 mb1, BW s2 mb0, F s2 mb1, BW s1 mb0, BW s2 mb1, BW s1 mb1
"""


def v_schedule():
    return Schedule("v-hand", (v_shape(2),), 2, parse_orders(V_2x2))


def test_1f1b_volume():
    p, m = 4, 8
    s = build("1f1b", ScheduleSpec(p, m))
    assert volume(s) == 2 * m * (p - 1)
    assert all(abs(msg.src - msg.dst) == 1 for msg in messages(s))


def test_v_turn_is_local_and_volume_doubles():
    s = v_schedule()
    assert validate(s) == []
    found = messages(s)
    assert volume(s) == 2 * 2 * (2 * 2 - 2)  # twice 1F1B's 2*m*(p-1)
    assert not any({msg.producer.stage, msg.consumer.stage} == {1, 2} for msg in found)
    assert not any({msg.producer.stage, msg.consumer.stage} == {0, 3} and msg.payload == "activation" for msg in found)


def test_receives_are_posted_in_send_order():
    rank1 = program(v_schedule())[1]
    recvs = [str(step) for step in rank1 if isinstance(step, CommStep) and step.op is CommOp.RECV]
    assert recvs[:3] == [
        "RECV activation for F s1 mb0 from rank 0",
        "RECV gradient for BW s2 mb0 from rank 0",
        "RECV activation for F s1 mb1 from rank 0",
    ]
    # the early-posted gradient receive comes before F s1 mb1, which needs only the activation
    position = {str(step): i for i, step in enumerate(rank1)}
    assert position["RECV gradient for BW s2 mb0 from rank 0"] < position[str(Pass.parse("F s1 mb1"))]


@pytest.mark.parametrize("name", names())
def test_program_places_every_message_once_in_channel_order(name):
    s = build(name, ScheduleSpec(4, 8))
    for rank, steps in enumerate(program(s)):
        seen = {}
        done = set()
        for step in steps:
            if isinstance(step, CommStep):
                msg = step.message
                key = (step.op, step.peer)
                assert msg.seq == seen.get(key, -1) + 1, (rank, str(step))
                seen[key] = msg.seq
                if step.op is CommOp.SEND:
                    assert msg.producer in done
                else:
                    assert msg.consumer not in done
            else:
                done.add(step)
    sends = sum(1 for steps in program(s) for x in steps if isinstance(x, CommStep) and x.op is CommOp.SEND)
    recvs = sum(1 for steps in program(s) for x in steps if isinstance(x, CommStep) and x.op is CommOp.RECV)
    assert sends == recvs == volume(s)


def test_an_overlapped_pair_takes_both_inputs_before_and_sends_both_outputs_after():
    s = build("1f1b", ScheduleSpec(3, 6))
    order = s.orders[1]  # the middle rank receives and sends for both passes
    forward = Pass.parse("F s1 mb2")
    backward = order[order.index(forward) + 1]
    assert str(backward) == "BW s1 mb1"
    paired = Schedule(s.name, s.placements, s.microbatches, s.orders, overlapped=((forward, backward),))
    steps = [str(step) for step in program(paired)[1]]
    at = steps.index("F s1 mb2")
    assert steps[at - 2 : at + 4] == [
        "RECV activation for F s1 mb2 from rank 0",
        "RECV gradient for BW s1 mb1 from rank 2",
        "F s1 mb2",
        "BW s1 mb1",
        "SEND activation of F s1 mb2 to rank 2",
        "SEND gradient of BW s1 mb1 to rank 0",
    ]
    assert len(steps) == len(program(s)[1])  # the same steps, moved


@pytest.mark.parametrize(
    "pair, why",
    [
        (("F s1 mb2", "F s1 mb3"), "an F and a B or BW"),
        (("F s1 mb2", "BW s1 mb2"), "next to each other"),
        (("F s0 mb2", "BW s1 mb1"), "next to each other"),
    ],
)
def test_a_pair_that_cannot_run_as_one_step_is_refused(pair, why):
    s = build("1f1b", ScheduleSpec(3, 6))
    with pytest.raises(ScheduleError, match=why):
        Schedule(s.name, s.placements, s.microbatches, s.orders, overlapped=(tuple(map(Pass.parse, pair)),))
