"""IR, placements and text round trips; the schedule core never imports torch."""

import subprocess
import sys

import pytest

from megatron_zb.schedule.ir import BW, F, Pass, PassKind, Schedule, ScheduleError, made_pass, parse_orders
from megatron_zb.schedule.placement import interleaved, linear, mirrored, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build, names
from megatron_zb.schedule.simulate import simulate
from megatron_zb.schedule.validate import validate


def test_pass_text_round_trip():
    for p in (Pass(PassKind.BW, 3, 12), Pass(PassKind.W, 0, 0, pipe=1), F(7, 2)):
        assert Pass.parse(str(p)) == p
    assert str(Pass(PassKind.B, 2, 5, 1)) == "B s2 mb5 d1"
    with pytest.raises(ValueError, match="cannot parse pass 'X s1 mb1'"):
        Pass.parse("X s1 mb1")


def test_a_made_pass_is_the_pass():
    made, built = made_pass(PassKind.B, 3, 5, 1), Pass(PassKind.B, 3, 5, 1)
    assert type(made) is Pass and made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert made < Pass(PassKind.B, 3, 6, 1) and sorted([Pass(PassKind.B, 3, 6, 1), made])[0] is made
    with pytest.raises(AttributeError):
        made.stage = 4  # still frozen


@pytest.mark.parametrize("name", names())
def test_schedule_text_round_trip(name):
    s = build(name, ScheduleSpec(4, 8))
    assert parse_orders(s.to_text()) == s.orders


def test_placements():
    assert [linear(3).rank_of(s) for s in range(3)] == [0, 1, 2]
    loop = interleaved(4, 2)
    assert [(loop.rank_of(s), loop.chunk_of(s)) for s in (0, 3, 4, 7)] == [(0, 0), (3, 0), (0, 1), (3, 1)]
    v = v_shape(4)
    assert [v.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stage_of(0, 1) == 7 and v.stage_of(3, 1) == 4
    assert [v.full_stage(s) for s in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    back = mirrored(v)
    assert [back.rank_of(s) for s in range(8)] == [3, 2, 1, 0, 0, 1, 2, 3]
    assert {back.chunk_of(s) for s in range(8)} == {2, 3}
    with pytest.raises(ValueError, match="even number of chunks"):
        v_shape(4, 3)


def test_two_pipes_share_no_chunk():
    with pytest.raises(ScheduleError, match="rank 0 chunk 0 is used by pipes 0 and 1"):
        Schedule("x", (linear(2), linear(2)), 1, ((), ()))


def test_bidirectional_schedule_is_representable():
    """Two placements at once (BitPipe's directions): mb0 goes down, mb1 comes up."""
    down, up = linear(2), mirrored(linear(2))
    orders = (
        (F(0, 0), F(1, 1, 1), BW(1, 1, 1), BW(0, 0)),
        (F(0, 1, 1), F(1, 0), BW(1, 0), BW(0, 1, 1)),
    )
    s = Schedule("bidirectional", (down, up), 2, orders)
    assert validate(s) == []
    t = simulate(s)
    assert t.makespan == 3 + 3  # two F, then two BW (cost 2) chained across the ranks
    assert [p.chunk for p in t.ranks[0]] == [0, 1, 1, 0]


def test_schedule_core_imports_no_torch():
    code = (
        "import sys, megatron_zb, megatron_zb.schedule.registry as r, megatron_zb.cli, megatron_zb.render\n"
        "r.names()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
