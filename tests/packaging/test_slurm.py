"""The Slurm scripts launch what they promise: one container and torchrun per node, and flags that pick their schedule.

Each sbatch script runs here in its dry-run mode (``MEGATRON_ZB_DRY_RUN=1`` prints the srun
command instead of running it) under a fake two-node allocation. The training flags in that
command go through the parser the job itself uses and ``schedule_settings``, so a typo, a lost
schedule flag or a layer count that does not split fails here rather than after a queue wait.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_zb.megatron.args import ZeroBubbleSettings, schedule_settings
from megatron_zb.training.arguments import build_parser, derive_and_check

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
# script -> the schedule its flags select
SCRIPTS = {"zb-2p.sbatch": "zb-2p", "zb-v.sbatch": "zb-v", "v-half-post-validation.sbatch": "v-half"}
NODES, GPUS = 2, 8
ALLOCATION = {
    "SLURM_NNODES": str(NODES),
    "SLURM_GPUS_ON_NODE": str(GPUS),
    "SLURM_JOB_ID": "4242",
    "SLURM_SUBMIT_DIR": "/shared/megatron-zb",
}
LAUNCHER = ["-m", "megatron_zb.pretrain_gpt"]
# Megatron-LM's pretrain_gpt flags that zb-2p.sbatch adds for real data and megatron-zb's launcher lacks.
MEGATRON_LM_ONLY = {"--split", "--tokenizer-type", "--vocab-file", "--merge-file", "--eval-interval", "--eval-iters"}


@dataclass(frozen=True)
class Launch:
    """A dry run's command, cut where srun, torchrun, the entry point and the training flags begin."""

    srun: list[str]
    torchrun: list[str]
    entry: list[str]
    flags: list[str]


def dry_run(script: str, **env: str) -> Launch:
    environment = {"PATH": os.environ["PATH"], "MEGATRON_ZB_DRY_RUN": "1", **ALLOCATION, **env}
    result = subprocess.run(
        ["bash", str(SLURM / script)], env=environment, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, f"{script}: the dry run failed:\n{result.stderr}"
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert command[0] == "srun", f"{script}: the dry run printed no srun command: {result.stdout}"
    start = command.index("torchrun")
    entry = start + 1
    while command[entry].startswith("--"):
        entry += 1
    flags = entry + 2 if command[entry] == "-m" else entry + 1
    return Launch(command[:start], command[start:entry], command[entry:flags], command[flags:])


def options(words: list[str]) -> dict[str, str]:
    return dict(word.split("=", 1) for word in words if word.startswith("--") and "=" in word)


def strict_parser() -> argparse.ArgumentParser:
    """The launcher's parser without abbreviations, as Megatron-LM parses: a truncated flag is a typo."""
    parser = build_parser()
    parser.allow_abbrev = False
    return parser


def launcher_settings(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, world: int = NODES * GPUS
) -> ZeroBubbleSettings | None:
    """What `python -m megatron_zb.pretrain_gpt` does with the flags before any process group exists."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = strict_parser().parse_args(flags)
    derive_and_check(args)
    return schedule_settings(args)


@pytest.mark.parametrize("name", [*SCRIPTS, "common.sh"])
def test_bash_syntax(name: str) -> None:
    result = subprocess.run(["bash", "-n", str(SLURM / name)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{name}: bash -n: {result.stderr}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_header_and_common(script: str) -> None:
    text = (SLURM / script).read_text()
    assert re.search(r"^source .*common\.sh\"?$", text, re.M), f"{script} does not source common.sh"
    assert re.search(r"^#SBATCH --nodes=\d+$", text, re.M), f"{script} has no #SBATCH --nodes line"
    assert re.search(r"^#SBATCH --(gpus|ntasks)-per-node=\d+$", text, re.M), (
        f"{script} has no #SBATCH --gpus-per-node (or --ntasks-per-node) line"
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_container_and_torchrun_per_node(script: str) -> None:
    launch = dry_run(script)
    srun, torchrun = options(launch.srun), options(launch.torchrun)
    for flag in ("--container-image", "--container-mounts", "--container-workdir"):
        assert flag in srun, f"{script}: srun has no {flag}: {launch.srun}"
    assert srun["--container-mounts"] == "/shared/megatron-zb:/workspace", "the submit directory is not mounted"
    assert (srun["--nodes"], srun["--ntasks-per-node"]) == (str(NODES), "1"), f"{script}: not one task per node"
    assert torchrun["--rdzv-backend"] == "c10d", f"{script}: torchrun does not use the c10d rendezvous"
    assert re.fullmatch(r"[\w.-]+:\d+", torchrun["--rdzv-endpoint"]), f"{script}: bad rendezvous endpoint"
    assert (torchrun["--nnodes"], torchrun["--nproc-per-node"]) == (str(NODES), str(GPUS)), (
        f"{script}: torchrun's node and process counts do not follow SLURM_NNODES and the GPUs per node"
    )


def test_finds_common_sh_from_the_sbatch_spool_copy(tmp_path: Path) -> None:
    """sbatch runs a copy of the script from its spool directory; common.sh then comes from the submit dir."""
    spool = tmp_path / "slurm_script"
    spool.write_text((SLURM / "zb-v.sbatch").read_text())
    environment = {"PATH": os.environ["PATH"], "MEGATRON_ZB_DRY_RUN": "1", **ALLOCATION, "SLURM_SUBMIT_DIR": str(ROOT)}
    result = subprocess.run(["bash", str(spool)], env=environment, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "torchrun" in result.stdout, f"the spool copy failed: {result.stderr}"


def test_default_image_is_the_one_the_dockerfile_documents() -> None:
    built = re.search(r"docker build -t (\S+) \.", (ROOT / "Dockerfile").read_text())
    assert built, "the Dockerfile does not document its `docker build -t NAME .` line"
    image = options(dry_run("zb-v.sbatch").srun)["--container-image"]
    assert image == built.group(1), f"common.sh runs {image}, the Dockerfile builds {built.group(1)}"
    override = options(dry_run("zb-v.sbatch", MEGATRON_ZB_IMAGE="/images/zb.sqsh").srun)["--container-image"]
    assert override == "/images/zb.sqsh", "MEGATRON_ZB_IMAGE does not choose the image"


def test_nccl_environment() -> None:
    """What common.sh exports reaches every container (srun --export=ALL); user settings win."""
    script = f"source {shlex.quote(str(SLURM / 'common.sh'))} && env"
    base = {"PATH": os.environ["PATH"], **ALLOCATION}
    env = subprocess.run(["bash", "-c", script], env=base, capture_output=True, text=True, check=True).stdout
    exported = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
    assert exported.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "Megatron needs CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert exported.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1", "NCCL errors must abort the job"
    assert "NCCL_SOCKET_IFNAME" in exported and "NCCL_IB_DISABLE" in exported, "NCCL network settings missing"
    mine = {**base, "NCCL_SOCKET_IFNAME": "ib0"}
    env = subprocess.run(["bash", "-c", script], env=mine, capture_output=True, text=True, check=True).stdout
    assert "NCCL_SOCKET_IFNAME=ib0" in env.splitlines(), "a user's NCCL_SOCKET_IFNAME is overwritten"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_flags_select_the_schedule(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = dry_run(script)
    assert launch.entry == LAUNCHER, f"{script}: expected megatron-zb's launcher, got {launch.entry}"
    settings = launcher_settings(launch.flags, monkeypatch)
    assert settings is not None and settings.schedule == SCRIPTS[script], f"{script}: runs {settings}"


@pytest.mark.parametrize(
    "script, env, nodes, schedule",
    [
        ("zb-2p.sbatch", {"PP": "8", "NUM_LAYERS": "48"}, 4, "zb-2p"),  # max pending backward follows PP: 16
        ("zb-v.sbatch", {"PP": "8", "NUM_LAYERS": "48", "TP": "1"}, 1, "zb-v"),
        ("zb-v.sbatch", {"GLOBAL_BATCH_SIZE": "128", "MICRO_BATCH_SIZE": "2"}, 2, "zb-v"),
    ],
)
def test_overrides_keep_the_schedule(
    script: str, env: dict[str, str], nodes: int, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = dry_run(script, SLURM_NNODES=str(nodes), **env)
    assert options(launch.torchrun)["--nnodes"] == str(nodes)
    settings = launcher_settings(launch.flags, monkeypatch, world=nodes * GPUS)
    assert settings is not None and settings.schedule == schedule, f"{script} with {env}: runs {settings}"


def test_a_layer_count_that_does_not_split_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """36 layers do not split into ZB-V's 2 x 4 blocks: the check that guards the defaults can fail."""
    launch = dry_run("zb-v.sbatch", NUM_LAYERS="36")
    with pytest.raises(ValueError, match="zb-v"):
        launcher_settings(launch.flags, monkeypatch)


def test_zb_2p_with_data_runs_megatron_lm(monkeypatch: pytest.MonkeyPatch) -> None:
    """DATA_PATH switches to the patched Megatron-LM pretrain_gpt.py in the image, still ZB-2p."""
    data = "0.7 /data/web_text_document 0.3 /data/code_text_document"
    launch = dry_run("zb-2p.sbatch", DATA_PATH=data, VOCAB_FILE="/data/vocab.json", MERGE_FILE="/data/merges.txt")
    assert launch.entry == ["/opt/Megatron-LM/pretrain_gpt.py"], f"expected Megatron-LM's script, got {launch.entry}"
    args, unknown = strict_parser().parse_known_args(launch.flags)
    assert args.data_path == data.split(), f"DATA_PATH reached Megatron-LM as {args.data_path}"
    unexpected = {word for word in unknown if word.startswith("--")} - MEGATRON_LM_ONLY
    assert not unexpected, f"flags that neither Megatron-LM's list here nor the launcher knows: {unexpected}"
    args.data_parallel_size = NODES * GPUS // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    settings = schedule_settings(args)
    assert settings is not None and settings.schedule == "zb-2p", f"runs {settings}"


def test_zb_2p_with_data_needs_the_tokenizer_files() -> None:
    environment = {"PATH": os.environ["PATH"], "MEGATRON_ZB_DRY_RUN": "1", **ALLOCATION, "DATA_PATH": "/data/x"}
    result = subprocess.run(
        ["bash", str(SLURM / "zb-2p.sbatch")], env=environment, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0 and "VOCAB_FILE" in result.stderr, "DATA_PATH without VOCAB_FILE was accepted"


def test_v_half_runs_with_post_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    script = "v-half-post-validation.sbatch"
    launch = dry_run(script)
    assert launch.entry == LAUNCHER, f"{script}: V schedules need megatron-zb's launcher, got {launch.entry}"
    settings = launcher_settings(launch.flags, monkeypatch)
    assert settings is not None and settings.schedule == "v-half", f"{script}: runs {settings}"
    assert settings.post_validation and settings.post_validation_rollback == "exact", settings
