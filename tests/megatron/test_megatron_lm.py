"""``--megatron-lm`` hands our flags and schedule to Megatron-LM's pretrain(), checked before it starts.

Megatron-LM is not installed here: stand-in checkouts (``megatron.training`` and a pretrain_gpt.py)
record what they are given. Their ``validate_args`` does what the real one does to the fields we
read (megatron/training/arguments.py, core_v0.16.1 to main): it copies ``num_layers`` into
``encoder_num_layers`` (and ``seq_length`` into ``encoder_seq_length``) for every model, GPT
included, or the other way round when only ``--encoder-num-layers`` is given (T5). The older
stand-in takes ``pretrain(datasets, model_provider, ...)`` and parses inside (Megatron-LM <= 0.17);
the newer one ``pretrain(cfg_container, ...)`` after ``parse_and_validate_args()`` (>= 0.18).
Like the real one, it derives ``virtual_pipeline_model_parallel_size`` from the virtual-stage
flags or ``--pipeline-model-parallel-layout`` and leaves it None without them; a V schedule gets
its two chunks per rank from megatron-zb's check, which runs right after.
tests/megatron/test_real_megatron_lm.py runs the real thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PARSE = """
import argparse, sys
from . import initialize

def parse(extra_args_provider, defaults):
    parser = argparse.ArgumentParser()
    for flag in ("--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size"):
        parser.add_argument(flag, type=int, default=1)
    for flag in ("--num-layers", "--encoder-num-layers", "--decoder-num-layers", "--seq-length",
                 "--num-virtual-stages-per-pipeline-rank"):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-layout", default=None)
    extra_args_provider(parser)
    args = parser.parse_args(sys.argv[1:])
    for key, value in (defaults or {}).items():
        setattr(args, key, value)
    return initialize.validate_args(args, defaults)
"""

PRETRAIN = """
import json
from . import global_vars, parsing

def pretrain(datasets, model_provider, model_type, forward_step, args_defaults=None, extra_args_provider=None,
             get_embedding_ranks=None, **kw):
    args = parsing.parse(extra_args_provider, args_defaults)
    global_vars._GLOBAL_ARGS = args
    from megatron.core.pipeline_parallel import get_forward_backward_func
    runner = get_forward_backward_func()
    args.model_type = model_type  # get_model() sets it, after validate_args
    print(json.dumps({"runner": getattr(runner, "name", None), "provider": model_provider(),
                      "datasets_distributed": datasets.is_distributed, "step": forward_step.__name__,
                      "defaults": args_defaults, "embedding_ranks": get_embedding_ranks([0, 3]),
                      "encoder_num_layers": args.encoder_num_layers,
                      "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size}))
"""

PRETRAIN_CONFIG = """
import json
from . import global_vars

def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func, model_provider=None,
             get_embedding_ranks=None, **kw):
    args = cfg_container["args"]
    global_vars._GLOBAL_ARGS = args
    from megatron.core.pipeline_parallel import get_forward_backward_func
    runner = get_forward_backward_func()
    print(json.dumps({"runner": getattr(runner, "name", None), "config": cfg_container["model"],
                      "datasets_distributed": train_valid_test_dataset_provider.is_distributed,
                      "step": forward_step_func.__name__, "embedding_ranks": get_embedding_ranks([0, 3]),
                      "encoder_num_layers": args.encoder_num_layers,
                      "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size}))
"""

ARGUMENTS = """
from . import initialize, parsing
from .initialize import validate_args

def parse_and_validate_args(extra_args_provider=None, args_defaults=None):
    return parsing.parse(extra_args_provider, args_defaults)
"""

ARGUMENT_UTILS = """
def gpt_config_from_args(args):
    return "gpt config"

def pretrain_cfg_container_from_args(args, model_cfg):
    return {"args": args, "model": model_cfg}
"""

# What megatron/training/arguments.py validate_args does to the fields megatron-zb reads.
VALIDATE = """
def validate_args(args, defaults=None):
    args.data_parallel_size = 1
    if args.num_layers is not None:
        assert args.encoder_num_layers is None, 'cannot have both num-layers and encoder-num-layers specified'
        args.encoder_num_layers = args.num_layers
    else:
        assert args.encoder_num_layers is not None, 'either num-layers or encoder-num-layers should be specified'
        args.num_layers = args.encoder_num_layers
    if args.seq_length is not None:
        args.encoder_seq_length = args.seq_length
    if args.pipeline_model_parallel_layout is not None:
        stages = args.pipeline_model_parallel_layout.count("|") + 1
        args.virtual_pipeline_model_parallel_size = stages // args.pipeline_model_parallel_size
    else:
        args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    return args
"""

SCRIPT = """
def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    return None, None, None

def model_provider(pre_process=True, post_process=True, vp_stage=None):
    return "pretrain_gpt.model_provider"

def forward_step(data_iterator, model):
    return None

def get_embedding_ranks(pp_ranks):
    return [pp_ranks[0], pp_ranks[-1]]
"""


def _checkout(root: Path, config_container: bool) -> Path:
    training = root / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text(textwrap.dedent(PRETRAIN_CONFIG if config_container else PRETRAIN))
    (training / "parsing.py").write_text(textwrap.dedent(PARSE))
    (training / "initialize.py").write_text(textwrap.dedent(VALIDATE))
    (training / "global_vars.py").write_text("_GLOBAL_ARGS = None\n")
    (training / "training.py").write_text("from . import pretrain\n\ndef training_log(*args, **kwargs):\n    pass\n")
    if config_container:
        (training / "arguments.py").write_text(textwrap.dedent(ARGUMENTS))
        (training / "argument_utils.py").write_text(textwrap.dedent(ARGUMENT_UTILS))
    (root / "pretrain_gpt.py").write_text(textwrap.dedent(SCRIPT))
    return root


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return _checkout(tmp_path_factory.mktemp("Megatron-LM"), config_container=False)


@pytest.fixture(scope="module")
def config_checkout(tmp_path_factory) -> Path:
    return _checkout(tmp_path_factory.mktemp("Megatron-LM-0.18"), config_container=True)


def launch(flags: str, checkout: Path | None, by_flag: bool = False) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MEGATRON_LM_PATH")}
    path = []
    if checkout is not None and by_flag:
        path = [str(checkout)]
    elif checkout is not None:
        env["MEGATRON_LM_PATH"] = str(checkout)
    command = [sys.executable, "-m", "megatron_zb.pretrain_gpt", "--megatron-lm", *path, *flags.split()]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


SHAPE = "--pipeline-model-parallel-size 4 --num-layers 8 --micro-batch-size 1 --global-batch-size 8"


@pytest.mark.parametrize("by_flag", [False, True], ids=["MEGATRON_LM_PATH", "--megatron-lm PATH"])
def test_pretrain_runs_our_schedule_with_the_scripts_providers(checkout: Path, by_flag: bool) -> None:
    done = launch(f"{SHAPE} --enable-zero-bubble --zero-bubble-max-pending-backward 8", checkout, by_flag)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "runner": "zb-2p",
        "provider": "pretrain_gpt.model_provider",
        "datasets_distributed": True,
        "step": "forward_step",
        "defaults": {"tokenizer_type": "GPT2BPETokenizer"},
        "embedding_ranks": [0, 3],
        "encoder_num_layers": 8,  # validate_args copies --num-layers, for GPT too
        "virtual_pipeline_model_parallel_size": None,
    }


def test_config_container_pretrain_gets_what_pretrain_gpt_builds(config_checkout: Path) -> None:
    done = launch(f"{SHAPE} --pipeline-schedule zb-1p", config_checkout)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "runner": "zb-1p",
        "config": "gpt config",
        "datasets_distributed": True,
        "step": "forward_step",
        "embedding_ranks": [0, 3],
        "encoder_num_layers": 8,
        "virtual_pipeline_model_parallel_size": None,
    }


@pytest.mark.parametrize("flags", ["--zero-bubble-v-schedule", "--pipeline-schedule v-half"])
@pytest.mark.parametrize("container", [False, True], ids=["pretrain-parses", "config-container"])
def test_v_schedule_gets_two_chunks_per_rank(
    checkout: Path, config_checkout: Path, flags: str, container: bool
) -> None:
    """Megatron-LM left virtual_pipeline_model_parallel_size None; get_model then builds one chunk per rank."""
    done = launch(f"{SHAPE} {flags}", config_checkout if container else checkout)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["runner"] == flags.split()[-1].replace("--zero-bubble-v-schedule", "zb-v")
    assert found["virtual_pipeline_model_parallel_size"] == 2


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            "--zero-bubble-v-schedule --pipeline-model-parallel-layout E|t|t|t|t|t|t|t|tL",
            [
                "zb-v places its layer blocks itself (v placement: rank 0 holds layer blocks 0 and 7 of 8)",
                "--pipeline-model-parallel-layout lays layers out by megatron's looping placement",
                "drop it",
            ],
        ),
        (
            "--zero-bubble-v-schedule --num-layers 14 --allow-padding-num-layers",
            ["Megatron-LM needs --num-layers divisible by 8", "[1, 2, 2, 2, 2, 2, 2, 1]", "megatron-zb train"],
        ),
        ("--pipeline-schedule zb-h1 --num-layers 6", ["--num-layers 6", "4 or 8"]),
    ],
)
def test_refusals_come_before_pretrain_starts(checkout: Path, flags: str, words: list[str]) -> None:
    done = launch(f"{SHAPE} {flags}", checkout)
    assert done.returncode != 0 and "runner" not in done.stdout
    for word in words:
        assert word in done.stderr, done.stderr


def test_encoder_decoder_model_is_refused(checkout: Path) -> None:
    shape = "--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 8"
    done = launch(f"{shape} --encoder-num-layers 8 --decoder-num-layers 8 --enable-zero-bubble", checkout)
    assert done.returncode != 0 and "runner" not in done.stdout
    assert "encoder-decoder models (--encoder-num-layers with --decoder-num-layers, as T5)" in done.stderr


def _installed_megatron_training() -> bool:
    """megatron-core >= 0.17 ships megatron.training: --megatron-lm then needs no checkout (megatron_lm/script.py)."""
    import importlib.util

    return importlib.util.find_spec("megatron.training") is not None


@pytest.mark.skipif(
    _installed_megatron_training(),
    reason="the installed megatron-core ships megatron.training: nothing is missing (test_verify_megatron_lm runs it)",
)
def test_missing_checkout_says_what_to_do() -> None:
    done = launch(SHAPE, None)
    assert done.returncode == 2
    assert "Megatron-LM checkout" in done.stderr and "MEGATRON_LM_PATH" in done.stderr


def test_missing_package_is_named(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "Megatron-LM", config_container=False)
    init = root / "megatron" / "training" / "__init__.py"
    init.write_text("import megatron_zb_absent_dependency\n" + init.read_text())
    done = launch(SHAPE, root)
    assert done.returncode == 2
    assert "needs the package 'megatron_zb_absent_dependency'" in done.stderr, done.stderr
    assert "megatron-zb[megatron-lm]" in done.stderr and "checkout" not in done.stderr


def test_megatron_lm_path_that_is_not_a_directory(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MEGATRON_LM_PATH")}
    command = [sys.executable, "-m", "megatron_zb.pretrain_gpt", "--megatron-lm", str(tmp_path / "nowhere"), "--cpu"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert f"--megatron-lm {tmp_path / 'nowhere'}: not a directory" in done.stderr


def test_an_exit_inside_pretrain_is_a_failure_unless_an_exit_flag_asked_for_it() -> None:
    from megatron_zb.megatron_lm.launch import early_exit_problem

    # load_checkpoint's "Unable to load rng state ... exiting ..." is sys.exit() with no status
    assert "gave up (its last message above says why)" in early_exit_problem(None, ["--load", "ckpt"])
    assert early_exit_problem(0, ["--train-iters", "10"]) is not None
    assert early_exit_problem(None, ["--exit-interval", "5"]) is None
    assert early_exit_problem(0, ["--exit-duration-in-mins=30"]) is None
    assert early_exit_problem(3, ["--exit-interval", "5"]) == "Megatron-LM exited: 3"
