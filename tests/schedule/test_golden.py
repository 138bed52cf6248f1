"""Exact per-rank orders of every generator at pp=4, m=6 (interleaved: chunks=2, m=8; BitPipe: m=8).

The files were checked against the closed forms in test_closed_forms.py when written; to
rewrite them after an intended change run `REGENERATE_GOLDEN=1 pytest tests/schedule/test_golden.py`
and review the diff.
"""

import os
from pathlib import Path

import pytest

from megatron_zb.schedule.ir import parse_orders
from megatron_zb.schedule.registry import ScheduleSpec, build, names

GOLDEN = Path(__file__).parent / "golden"
SPECS = {"interleaved-1f1b": ScheduleSpec(4, 8, 2), "bitpipe": ScheduleSpec(4, 8), "bitpipe-zb": ScheduleSpec(4, 8)}


@pytest.mark.parametrize("name", names())
def test_orders_match_golden_file(name):
    schedule = build(name, SPECS.get(name, ScheduleSpec(4, 6)))
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("REGENERATE_GOLDEN"):
        path.write_text(schedule.to_text() + "\n")
    assert path.exists(), f"no golden file for {name}; run with REGENERATE_GOLDEN=1 and review it"
    assert schedule.orders == parse_orders(path.read_text())
