"""``megatron-zb verify`` on megatron-zb's own loop: where no Megatron-LM is importable (megatron-core 0.16.1).

It passes a correct setting and names the first iteration of a wrong gradient. The passing case runs
the real command (one set of gloo processes for both runs); the failing case calls ``verify.main`` with
its test-only hook that scales one gradient at iteration 2. Where Megatron-LM's training package is
importable verify runs its ``pretrain()`` instead (test_verify_megatron_lm.py, test_verify_scale.py).
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from megatron_zb import verify
from megatron_zb.flags.megatron_lm_parser import megatron_lm_parser

pytestmark = pytest.mark.skipif(
    megatron_lm_parser() is not None, reason="Megatron-LM is importable: verify runs its pretrain() (other modules)"
)

# A user's pretrain_gpt line (GPU sizes, real data): verify shrinks it and uses mock data.
USER = (
    "--pipeline-model-parallel-size 2 --pipeline-schedule zb-v --num-layers 24 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json "
    "--merge-file merges.txt --data-path corpus_text_document --micro-batch-size 1 --global-batch-size 256 "
    "--train-iters 50000 --lr 3e-4 --lr-warmup-iters 500 --lr-decay-style cosine --clip-grad 1.0"
)


def test_a_correct_setting_passes() -> None:
    command = [sys.executable, "-m", "megatron_zb", "verify", "--verify-iters", "3", *USER.split()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "zb-v vs megatron-core's own schedule on a scaled-down copy: pipeline 2 x tensor 1 x data 1" in done.stdout
    assert "max relative loss difference: 0.00e+00" in done.stdout
    assert "max relative gradient difference (" in done.stdout
    assert "measured bubble (zb-v): " in done.stdout
    assert "OK: zb-v matches megatron-core's schedule within 1e-05 relative" in done.stdout


def test_a_wrong_gradient_fails_at_its_iteration() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = verify.main(["--verify-iters", "3", *USER.split()], inject_wrong_gradient_at=2)
    assert code == 1, out.getvalue()
    assert "MISMATCH at iteration 2: the grad norm differs by" in out.getvalue(), out.getvalue()


def test_the_verdict_names_each_quantity_with_its_own_difference() -> None:
    """A fp32 line's grad norm off by 2e-2 and its loss by 1e-4: each figure goes with its own name."""
    from megatron_zb.verify.verdict import Run, compare

    reference = Run(losses={1: 1.0, 2: 0.5}, grad_norms={1: 2.0, 2: 1.0})
    theirs = Run(losses={1: 1.0, 2: 0.50005}, grad_norms={1: 2.0, 2: 1.02})
    verdict = compare(reference, theirs, 1e-5)
    assert verdict.first_difference == 2
    assert verdict.reason == "the loss differs by 1.00e-04 relative and the grad norm differs by 2.00e-02 relative"
    theirs.losses[2] = 0.5
    assert compare(reference, theirs, 1e-5).reason == "the grad norm differs by 2.00e-02 relative"


def test_refuses_flags_without_a_schedule() -> None:
    err = io.StringIO()
    user = USER.replace("--pipeline-schedule zb-v", "")
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as raised:
        verify.main(user.split())
    assert raised.value.code == 2
    assert "megatron-zb verify: error: no megatron-zb schedule in these flags" in err.getvalue()


def test_flags_the_launcher_does_not_know_are_all_named() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as raised:
        verify.main(["--", *USER.split(), "--attention-backend", "auto", "--tensorboard-dir", "tb", "--bad"])
    assert raised.value.code == 2
    message = err.getvalue()
    listed = "--attention-backend auto, --tensorboard-dir tb, --bad"
    assert f"3 flags that megatron-zb's launcher does not know: {listed}" in message
    assert "--megatron-lm PATH" in message and "Traceback" not in message
