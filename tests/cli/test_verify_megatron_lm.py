"""``megatron-zb verify`` on Megatron-LM's own Llama-3 8B example line, through Megatron-LM's own ``pretrain()``.

The real command, as a user runs it: the example script's argv (test data) with one zero-bubble flag added,
after ``--``. Verify scales it (GQA 32:8 → 8:2, SwiGLU, RMSNorm, layernorm-1p, no biases, untied, RoPE, bf16,
distributed optimizer with both overlaps, per-token loss), trains it twice through ``pretrain()`` on gloo and
compares: zb-v at pipeline size 2 (the line has none: verify maps it), and zb-2p at pipeline size 4. Needs
``megatron.training``: the megatron-core 0.19.2 wheel's in CI, no checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zb.flags.megatron_lm_parser import megatron_lm_parser

EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"
pytestmark = pytest.mark.skipif(
    megatron_lm_parser() is None, reason="needs Megatron-LM's megatron.training (megatron-core >= 0.17)"
)


def verify(example: str, *flags: str) -> subprocess.CompletedProcess:
    argv = json.loads((EXAMPLES / f"{example}.json").read_text())["argv"]
    command = [sys.executable, "-m", "megatron_zb", "verify", "--", *argv, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_llama_example_with_zb_v_matches_megatron_cores_schedule() -> None:
    done = verify("llama3_8b_core_v0.19.0", "--zero-bubble-v-schedule")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "zb-v against megatron-core's own schedule, through Megatron-LM" in out
    assert "2 gloo processes, 4 iterations, bf16" in out
    assert "--num-query-groups" in out and "keeps the heads-to-groups ratio of 32:8" in out
    assert "kept as given (" in out and "--swiglu" in out and "--normalization RMSNorm" in out
    assert "optimizer steps skipped (inf/nan): 0 of 4" in out
    assert "OK: zb-v matches megatron-core's schedule within 1e-02 relative" in out
    losses = [line for line in out.splitlines() if line.strip().startswith(("1 ", "2 ", "3 ", "4 "))]
    assert len(losses) == 4


def test_llama_example_at_pipeline_size_4_with_zb_2p() -> None:
    done = verify(
        "llama3_8b_core_v0.16.1",
        "--pipeline-model-parallel-size",
        "4",
        "--enable-zero-bubble",
        "--zero-bubble-max-pending-backward",
        "8",
        "--normalization",
        "RMSNorm",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "zb-2p against megatron-core's own schedule" in done.stdout and "4 gloo processes" in done.stdout
    assert "max relative loss difference: 0.00e+00" in done.stdout
    assert "OK: zb-2p matches" in done.stdout
