"""Training runs a schedule from a file (--pipeline-schedule file:PATH) exactly as the registered one it came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_zb.cli import main as megatron_zb
from megatron_zb.testing.launcher import pool_losses
from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import parse

MODEL = (
    "--cpu --cpu-procs 2 --pipeline-model-parallel-size 2 --num-layers 8 --hidden-size 32 --num-attention-heads 4 "
    "--seq-length 16 --vocab-size 64 --mock-data --micro-batch-size 2 --global-batch-size 8 --train-iters 4 "
    "--lr 3e-3 --hidden-dropout 0 --attention-dropout 0 --seed 7"
)


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


def losses(pool: WorkerPool, schedule: str) -> dict[int, float]:
    return pool_losses(pool, parse(f"{MODEL} --pipeline-schedule {schedule}".split()))


def test_an_exported_zb_v_trains_like_zb_v(pool: WorkerPool, tmp_path: Path) -> None:
    path = tmp_path / "zb-v.csv"
    plan = ["plan", "--schedule", "zb-v", "--pp", "2", "-m", "4", "--format", "torch-csv", "-o", str(path)]
    assert megatron_zb(plan) == 0
    registered, from_file = losses(pool, "zb-v"), losses(pool, f"file:{path}")
    assert sorted(registered) == [1, 2, 3, 4] and registered[4] < registered[1]
    assert from_file == registered
