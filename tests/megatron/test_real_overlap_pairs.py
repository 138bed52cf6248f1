"""Overlapped F&B pairs through Megatron-LM's own pretrain(), against a real checkout.

The Mixtral-style MoE line of test_real_megatron_lm (pp 2 x EP 2, 4 gloo processes) under 1F1B re-planned from
iterations 2-3's measured costs with the all-to-all time: the re-plan places pairs (rank 0 says how many), the
executor runs them on the twin process groups inside Megatron-LM's own, and every iteration's loss and grad norm
equal megatron-core's 1F1B of the same line. Megatron-LM's ``--overlap-moe-expert-parallel-comm`` (megatron-core's
CUDA-stream overlap of its combined 1F1B) with a megatron-zb schedule means the same pairs; tensor and sequence
parallelism 2 under pairs equal megatron-core's 1F1B of that line. Skipped without a checkout, like
test_real_megatron_lm.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_real_megatron_lm import ITERATIONS, MOE, assert_rows_equal, launch, metric_rows

from megatron_zb.testing import checkouts

pytestmark = pytest.mark.skipif(not checkouts.available(), reason=checkouts.skip_reason())

TIMED = "--zero-bubble-pipeline-timers-start-iter 2 --zero-bubble-pipeline-timers-end-iter 3"
CASES = {
    "moe-1f1b": "",  # megatron-core's own schedule: the reference
    "1f1b-pairs": f"--pipeline-schedule 1f1b --zero-bubble-overlap-f-b {TIMED}",
    "a2a-ovlp-1f1b": f"--pipeline-schedule 1f1b --overlap-moe-expert-parallel-comm {TIMED}",
}
# Tensor parallelism 2 with sequence parallelism (expert parallelism carved from it, dp 1): a linear's backward
# all-gathers its input asynchronously into megatron-core's global memory buffer, which the forward side's gather
# would overwrite while pending (overlap.py gives the backward side its own)
SEQUENCE_PARALLEL = "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1"
SP_CASES = {"sp-1f1b": SEQUENCE_PARALLEL, "sp-1f1b-pairs": f"{SEQUENCE_PARALLEL} {CASES['1f1b-pairs']}"}
PAIRS = re.compile(r"re-planned \S+ -> \S+ with (\d+) overlapped F&B pairs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict[int, dict], str]]:
    """Each case's metric rows and its output, trained once."""
    tmp, found = tmp_path_factory.mktemp("megatron-lm-pairs"), {}
    for case, flags in {**CASES, **SP_CASES}.items():
        metrics = tmp / f"{case}.jsonl"
        done = launch(f"{MOE} {flags}", Path(metrics), "--train-iters", str(ITERATIONS), processes=4)
        assert done.returncode == 0, done.stderr[-4000:]
        found[case] = (metric_rows(metrics), done.stdout + done.stderr)
    return found


def placed_pairs(output: str) -> list[int]:
    """The pair counts of the re-plan lines in a run's output."""
    return [int(count) for count in PAIRS.findall(output)]


def test_1f1b_with_overlapped_pairs_equals_megatron_cores_1f1b(runs) -> None:
    reference, _ = runs["moe-1f1b"]
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS]["loss"] < reference[1]["loss"]
    rows, output = runs["1f1b-pairs"]
    counts = placed_pairs(output)
    assert counts and all(count > 0 for count in counts), output[-4000:]
    assert_rows_equal(rows, reference, ("loss", "grad_norm"), "1f1b-pairs")


def test_megatron_lms_a2a_overlap_flag_means_our_pairs(runs) -> None:
    """The flag is turned off before Megatron-LM sees it (its overlap needs CUDA streams), said in one line, and
    our 1F1B re-planned with pairs trains as megatron-core's 1F1B. (zb-1p takes the flag too, but its re-plan keeps
    zb-1p where the pairs predict no shorter iteration, as on a busy CPU.)"""
    rows, output = runs["a2a-ovlp-1f1b"]
    assert "--overlap-moe-expert-parallel-comm means --zero-bubble-overlap-f-b" in output, output[-4000:]
    counts = placed_pairs(output)
    assert counts and all(count > 0 for count in counts), output[-4000:]
    assert_rows_equal(rows, runs["moe-1f1b"][0], ("loss", "grad_norm"), "a2a-ovlp-1f1b")


def test_pairs_with_sequence_parallelism_equal_megatron_cores_1f1b(runs) -> None:
    """The backward side's asynchronous all-gather and the forward side's gather each have their own buffer."""
    reference, _ = runs["sp-1f1b"]
    rows, output = runs["sp-1f1b-pairs"]
    counts = placed_pairs(output)
    assert counts and all(count > 0 for count in counts), output[-4000:]
    assert_rows_equal(rows, reference, ("loss", "grad_norm"), "sp-1f1b-pairs")
