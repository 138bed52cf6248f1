"""A save killed for real (SIGKILL, no cleanup) at three points leaves a checkpoint that resumes bit-exact.

test_checkpoint_faults.py injects exceptions at every step of a save; this module kills the
training processes outright, as a lost node or an OOM killer would. ``megatron-zb train`` runs
a tiny GPT on two pipeline ranks; a ``sitecustomize`` on the workers' path makes the rank that
reaches the chosen step of one save send itself SIGKILL there. The runs are chained: each
resumes from what the previous one left and is killed in its own next save, the last one runs
to the end, and every loss must equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_zb.training.checkpoint import TRACKER

MODEL = (
    "--cpu --cpu-procs 2 --pipeline-model-parallel-size 2 --pipeline-schedule zb-h1 --num-layers 2 --hidden-size 16 "
    "--num-attention-heads 2 --seq-length 8 --vocab-size 32 --mock-data --micro-batch-size 1 --global-batch-size 4 "
    "--lr 3e-3 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --seed 7 --train-iters 8 --save-interval 2"
)
# (iteration whose save is killed, the step of the save it is killed at); see save_checkpoint's hook.
KILLS = ((4, "written"), (6, "renamed"), (8, "tracker"))

SITECUSTOMIZE = """
import os, signal
iteration, point = os.environ["MZB_TEST_KILL_AT"].split(":")
from megatron_zb.training import checkpoint
_save = checkpoint.save_checkpoint

def _kill_at(reached, path):
    if reached == point:
        os.kill(os.getpid(), signal.SIGKILL)

def save_checkpoint(directory, it, *args, **kwargs):
    if it == int(iteration):
        kwargs["hook"] = _kill_at
    return _save(directory, it, *args, **kwargs)

checkpoint.save_checkpoint = save_checkpoint
"""


def train(flags: str, metrics: Path, kill: tuple[int, str] | None, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if kill is not None:
        env["MZB_TEST_KILL_AT"] = f"{kill[0]}:{kill[1]}"
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "megatron_zb", "train", *MODEL.split(), *flags.split()]
    command += ["--metrics-file", str(metrics), "--distributed-timeout-minutes", "1"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def losses(metrics: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {row["iteration"]: row["loss"] for row in rows if row.get("loss") is not None}


def test_saves_killed_at_three_points_resume_bit_exact(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    reference = tmp_path / "reference.jsonl"
    done = train(f"--save {tmp_path / 'uninterrupted'}", reference, None, site)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 9))

    saved = tmp_path / "saved"
    got: dict[int, float] = {}
    resumed_from: list[int | None] = []
    for index, kill in enumerate((*KILLS, None)):
        metrics = tmp_path / f"run{index}.jsonl"
        load = f"--load {saved}" if index else ""
        done = train(f"--save {saved} {load}", metrics, kill, site)
        if kill is None:
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            assert done.returncode != 0, f"the run meant to die in save {kill} finished: {done.stdout[-2000:]}"
            # the supervisor names the killed rank's signal, and the tracker still names the last complete save
            assert "SIGKILL" in done.stderr + done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
            assert (saved / TRACKER).read_text() == f"{kill[0] - 2}\n", kill
        rows = losses(metrics) if metrics.exists() else {}
        resumed_from.append(min(rows, default=None))
        assert rows == {it: expected[it] for it in rows}, f"run {index} (killed at {kill}) differs"
        got.update(rows)
    # each run starts right after the save before the one that was killed, and together they cover 1-8
    assert resumed_from == [1, 3, 5, 7]
    assert got == expected
