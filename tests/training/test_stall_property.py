"""Property: a rank stalled anywhere, by SIGSTOP or by sleeping, is named within the timeout + 10 s.

Each example draws a stall (``testing.stall.draw_stall``): the rank, pp 2 or 4, megatron-zb's schedules or
megatron-core's own 1F1B, the iteration, the point (a model forward, the grad-norm all-reduce, the
checkpoint save) and how the rank stalls: SIGSTOP (its heartbeat stops with it) or a sleep (its heartbeat
goes on, its progress does not). The real launcher runs it with a 4 s timeout and must name that rank first,
within the timeout + 10 s of the stall, with no traceback. CI draws a few examples (derandomized);
``MZB_STALL_EXAMPLES=N`` draws more, and ``scripts/stall_campaign.py`` runs the acceptance campaign at
``--distributed-timeout-minutes 1`` (docs/stall_campaign.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zb.testing.stall import draw_stall

TIMEOUT_S = 4.0
EXAMPLES = int(os.environ.get("MZB_STALL_EXAMPLES", "2"))
NAMED = re.compile(r"megatron-zb train: timeout: ranks? (\d+)[ ,]")


def run_stall(fault: dict, flags: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, "-m", "megatron_zb.testing.stall", json.dumps(fault), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done, time.time()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_stalled_rank_is_named_first_within_the_timeout(tmp_path_factory, data) -> None:
    mark = tmp_path_factory.mktemp("stall") / "stalled"
    fault, flags = draw_stall(lambda choices: data.draw(st.sampled_from(choices)), str(mark), TIMEOUT_S)
    done, ended = run_stall(fault, flags)
    assert mark.exists(), f"the stall was never reached: {fault}\n{done.stderr[-3000:]}"
    seconds = ended - float(mark.read_text())
    named = NAMED.search(done.stderr)
    assert done.returncode == 1 and named, (fault, flags, done.stderr[-3000:])
    assert int(named.group(1)) == fault["rank"], (fault, done.stderr[-3000:])
    assert seconds <= TIMEOUT_S + 10, f"named {seconds:.1f} s after the stall: {fault}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    if fault["how"] == "sigstop":
        assert "its heartbeat stopped" in done.stderr and "last seen: " in done.stderr
