"""``--megatron-lm`` hands our flags and schedule to Megatron-LM's pretrain(), checked before it starts.

Megatron-LM is not installed here: a stand-in checkout (``megatron.training`` with pretrain,
initialize.validate_args and global_vars, and a pretrain_gpt.py) records what it is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRETRAIN = """
import argparse, json, sys
from . import global_vars, initialize

def pretrain(datasets, model_provider, model_type, forward_step, args_defaults=None, extra_args_provider=None, **kw):
    parser = argparse.ArgumentParser()
    for flag in ("--pipeline-model-parallel-size", "--num-layers", "--micro-batch-size", "--global-batch-size"):
        parser.add_argument(flag, type=int, default=1)
    extra_args_provider(parser)
    args = parser.parse_args(sys.argv[1:])
    initialize.validate_args(args, args_defaults)
    global_vars._GLOBAL_ARGS = args
    from megatron.core.pipeline_parallel import get_forward_backward_func
    runner = get_forward_backward_func()
    print(json.dumps({"runner": getattr(runner, "name", None), "provider": model_provider(),
                      "datasets_distributed": datasets.is_distributed, "step": forward_step.__name__,
                      "defaults": args_defaults}))
"""

VALIDATE = """
def validate_args(args, defaults=None):
    args.data_parallel_size = 1
    return args
"""

SCRIPT = """
def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    return None, None, None

def model_provider(pre_process=True, post_process=True, vp_stage=None):
    return "pretrain_gpt.model_provider"

def forward_step(data_iterator, model):
    return None
"""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("Megatron-LM")
    training = root / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text(textwrap.dedent(PRETRAIN))
    (training / "initialize.py").write_text(textwrap.dedent(VALIDATE))
    (training / "global_vars.py").write_text("_GLOBAL_ARGS = None\n")
    (root / "pretrain_gpt.py").write_text(textwrap.dedent(SCRIPT))
    return root


def launch(flags: str, checkout: Path | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MEGATRON_LM_PATH")}
    if checkout is not None:
        env["MEGATRON_LM_PATH"] = str(checkout)
    command = [sys.executable, "-m", "megatron_zb.pretrain_gpt", "--megatron-lm", *flags.split()]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


SHAPE = "--pipeline-model-parallel-size 4 --num-layers 8 --micro-batch-size 1 --global-batch-size 8"


def test_pretrain_runs_our_schedule_with_the_scripts_providers(checkout: Path) -> None:
    done = launch(f"{SHAPE} --enable-zero-bubble --zero-bubble-max-pending-backward 8", checkout)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "runner": "zb-2p",
        "provider": "pretrain_gpt.model_provider",
        "datasets_distributed": True,
        "step": "forward_step",
        "defaults": {"tokenizer_type": "GPT2BPETokenizer"},
    }


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--zero-bubble-v-schedule", ["zb-v", "V-shape", "megatron-zb train"]),
        ("--pipeline-schedule zb-h1 --num-layers 6", ["--num-layers 6", "4 or 8"]),
    ],
)
def test_refusals_come_before_pretrain_starts(checkout: Path, flags: str, words: list[str]) -> None:
    done = launch(f"{SHAPE} {flags}", checkout)
    assert done.returncode != 0 and "runner" not in done.stdout
    for word in words:
        assert word in done.stderr, done.stderr


def test_missing_checkout_says_what_to_do() -> None:
    done = launch(SHAPE, None)
    assert done.returncode == 2
    assert "Megatron-LM checkout" in done.stderr and "MEGATRON_LM_PATH" in done.stderr
