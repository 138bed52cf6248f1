"""The launcher's per-rank entry point run inside a worker pool: the losses a training run logs.

Tests compare schedules by these losses; running ``run_rank`` in a pool instead of spawning
``megatron-zb train --cpu`` per run saves a megatron-core import per rank and run.
"""

from __future__ import annotations

import argparse

from .pool import WorkerPool


def rank_losses(args: argparse.Namespace) -> dict[int, float]:
    """On a pooled worker: train this rank as the launcher does; iteration -> loss where it logged one."""
    import torch

    from megatron_zb.pretrain_gpt import run_rank

    rows = run_rank(args, torch.device("cpu"), gloo=True)
    return {row["iteration"]: row["loss"] for row in rows if row["loss"] is not None}


def pool_losses(pool: WorkerPool, args: argparse.Namespace) -> dict[int, float]:
    """The losses of a run on every rank of ``pool``; the ranks that log them must agree."""
    found = [losses for losses in pool.run(rank_losses, args=args) if losses]
    assert found and all(losses == found[0] for losses in found), "the logging ranks disagree on the losses"
    return found[0]


def launcher_probe(rank: int, launcher, folder: str, name: str) -> None:
    """A ``training.spawn.start_ranks`` worker: writes what ``name`` reads in its environment to folder/rank, and
    prints it to its stdout."""
    import os
    from pathlib import Path

    launcher.apply()
    value = os.environ.get(name, "(unset)")
    Path(folder, str(rank)).write_text(value)
    print(f"rank {rank}: {value}", flush=True)


def preloaded_probe(rank: int, launcher, folder: str, module: str) -> None:
    """A ``training.spawn.start_ranks`` worker: writes to folder/rank where the fork server imported ``module``
    from, before the rank touches ``sys.path`` ("(not preloaded)" when it did not)."""
    import sys
    from pathlib import Path

    found = sys.modules.get(module)
    Path(folder, str(rank)).write_text(getattr(found, "__file__", None) or "(not preloaded)")
