"""Checkpoints that cannot load corrupt, saves that a kill cannot break, resumes decided for all ranks.

One pool of four gloo processes (pp=2 x dp=2) serves the module. The checkpoint API runs on
the small GPT of test_checkpoint.py (damaged copies, a fault injected at each step of a save);
the launcher's ``run_rank`` runs the resume cases end to end, and ``parse`` the refusals that
must come before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint import Run

from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training import summary
from megatron_zb.training.arguments import parse
from megatron_zb.training.checkpoint import MANIFEST, METADATA, TRACKER

RANK_FILE = "mp_rank_00_001/model_optim_rng.pt"  # (tp 0, pp 1), written by global rank 2
MODEL = (
    "--cpu --cpu-procs 4 --pipeline-model-parallel-size 2 --global-batch-size 8 --num-layers 4 --hidden-size 32 "
    "--num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data --micro-batch-size 2 --lr 3e-3 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 2 --seed 7 --pipeline-schedule 1f1b"
)


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def snapshot(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# -- the checkpoint API on the small GPT ------------------------------------------------------
def save_two_runs(first: str, second: str) -> None:
    """Checkpoints of iterations 1 and 2 in ``first``; another run's (other data) of 1 in ``second``."""
    from megatron_zb.training.checkpoint import save_checkpoint

    run = Run("zb-h1", False, torch.float32)
    for iteration in (1, 2):
        run.train(iteration)
        save_checkpoint(first, iteration, run.chunks, run.optimizer, run.scheduler)
    other = Run("zb-h1", False, torch.float32)
    other.train(50)
    save_checkpoint(second, 1, other.chunks, other.optimizer, other.scheduler)


def attempt_loads(directories: dict[str, str]) -> dict[str, str]:
    """Each directory's load outcome on this rank: the error message, or "loaded N"."""
    from megatron_zb.training.checkpoint import CheckpointError, load_checkpoint

    run = Run("zb-h1", False, torch.float32)
    outcomes = {}
    for name, directory in directories.items():
        try:
            outcomes[name] = f"loaded {load_checkpoint(directory, run.chunks, run.optimizer, run.scheduler)[0]}"
        except CheckpointError as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
    return outcomes


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for offset in range(len(data) // 2, len(data) // 2 + 64):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(kind: str, directory: Path, other: Path) -> str:
    """Damage the checkpoint of iteration 2 in ``directory``; returns the path the refusal must name."""
    folder = directory / "iter_0000002"
    target = folder / RANK_FILE
    if kind == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "flipped":
        _flip(target)
    elif kind == "mixed":  # the same file of another run: same layout, same size
        shutil.copyfile(other / "iter_0000001" / RANK_FILE, target)
    elif kind == "missing file":
        target.unlink()
    elif kind == "no metadata":
        target = folder / METADATA
        target.unlink()
    elif kind == "no manifest":
        target = folder / MANIFEST
        target.unlink()
    elif kind == "damaged manifest":
        target = folder / MANIFEST
        target.write_text(target.read_text().replace('"iteration": 2', '"iteration": 3'))
    elif kind == "foreign file":
        target = folder / "mp_rank_00_002/model_optim_rng.pt"
        target.parent.mkdir()
        shutil.copyfile(folder / RANK_FILE, target)
    elif kind == "tracker names absent iteration":
        target = folder
        (directory / TRACKER).write_text("2\n")
        shutil.rmtree(folder)
    else:
        raise AssertionError(kind)
    return str(target)


DAMAGE = {
    "truncated": "is {size} bytes, manifest.json records",
    "empty": "is empty, manifest.json records",
    "flipped": "does not match its sha256 in manifest.json",
    "mixed": "does not match its sha256 in manifest.json",
    "missing file": "is missing (the checkpoint is incomplete or was moved)",
    "no metadata": "is missing (the checkpoint is incomplete or was moved)",
    "no manifest": "is missing (the save of iter_0000002 did not finish",
    "damaged manifest": "does not match its own sha256: the manifest is damaged",
    "foreign file": "is not in manifest.json",
    "tracker names absent iteration": "does not exist (complete checkpoints there: iter_0000001)",
}


def test_damaged_checkpoints_are_refused_by_name_on_every_rank(pool: WorkerPool, tmp_path: Path) -> None:
    good, other = tmp_path / "good", tmp_path / "other"
    pool.run(save_two_runs, first=str(good), second=str(other))
    directories, named = {"intact": str(good)}, {}
    for kind in DAMAGE:
        copy = tmp_path / kind.replace(" ", "-")
        shutil.copytree(good, copy)
        named[kind] = _damage(kind, copy, other)
        directories[kind] = str(copy)
    before = snapshot(good)
    outcomes = pool.run(attempt_loads, directories=directories)
    assert all(outcome == outcomes[0] for outcome in outcomes), "every rank decides the same"
    got = outcomes[0]
    assert got.pop("intact") == "loaded 2"
    size = (good / "iter_0000002" / RANK_FILE).stat().st_size // 2
    for kind, message in got.items():
        assert message.startswith("CheckpointError: "), (kind, message)
        assert named[kind] in message and DAMAGE[kind].format(size=size) in message, (kind, message)
    # the file is named with the ranks that met the problem: rank 2 wrote it, ranks 2 and 3 read it
    assert got["flipped"].startswith(f"CheckpointError: rank 2: checkpoint file {named['flipped']} does not")
    assert "ranks 0, 2, 3: checkpoint file" in got["truncated"]
    assert snapshot(good) == before


FAULTS = ("written", "staged", "renamed", "tracker")


def interrupted_save(directory: str, point: str) -> dict:
    """Save 2; a save of 3 dies at ``point``; a new run resumes from 2 and must match the run that went on."""
    from megatron_zb.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    def fault(reached: str, path: Path) -> None:
        if reached != point or (point == "written" and RANK_FILE not in path.as_posix()):
            return
        if reached in ("written", "tracker"):  # killed while writing: half a file
            path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
        raise RuntimeError(f"killed at {point}")

    a = Run("zb-h1", False, torch.float32)
    a.train(1)
    a.train(2)
    save_checkpoint(directory, 2, a.chunks, a.optimizer, a.scheduler)
    expected = [a.train(3)]
    try:
        save_checkpoint(directory, 3, a.chunks, a.optimizer, a.scheduler, hook=fault)
        error = None
    except CheckpointError as failed:
        error = str(failed)
    listing = sorted(p.name for p in Path(directory).iterdir())
    expected += [a.train(4), a.train(5)]  # the run that was not interrupted
    final = a.params()

    b = Run("zb-h1", False, torch.float32)
    loaded, _ = load_checkpoint(directory, b.chunks, b.optimizer, b.scheduler)
    got = [b.train(3)]
    save_checkpoint(directory, 3, b.chunks, b.optimizer, b.scheduler)  # over what the killed save left
    got += [b.train(4), b.train(5)]
    equal = all(torch.equal(x, y) for x, y in zip(b.params(), final, strict=True))
    c = Run("zb-h1", False, torch.float32)  # after b: the RNG state is the process's
    again, _ = load_checkpoint(directory, c.chunks, c.optimizer, c.scheduler)
    return {
        "error": error,
        "listing": listing,
        "loaded": loaded,
        "again": again,
        "exact": got == expected,
        "c_exact": [c.train(4), c.train(5)] == expected[1:],
        "params_equal": equal,
    }


@pytest.mark.parametrize("point", FAULTS)
def test_a_save_killed_at_any_step_leaves_the_previous_checkpoint(pool: WorkerPool, tmp_path: Path, point: str):
    results = pool.run(interrupted_save, directory=str(tmp_path), point=point)
    partial, tracker_tmp = ".iter_0000003.partial", TRACKER + ".tmp"
    listing = {
        "written": [partial, "iter_0000002", TRACKER],
        "staged": [partial, "iter_0000002", TRACKER],
        "renamed": ["iter_0000002", "iter_0000003", TRACKER],
        "tracker": ["iter_0000002", "iter_0000003", TRACKER, tracker_tmp],
    }[point]
    for rank, result in enumerate(results):
        culprit = "rank 2: " if point == "written" else "rank 0: RuntimeError"
        assert result["error"].startswith("writing" if point == "written" else "committing"), result["error"]
        assert culprit in result["error"] and f"killed at {point}" in result["error"]
        assert result["listing"] == listing, f"rank {rank}: {result['listing']}"
        assert result["loaded"] == 2 and result["again"] == 3
        assert result["exact"] and result["c_exact"] and result["params_equal"], f"rank {rank}: {result}"
    assert (tmp_path / TRACKER).read_text() == "3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000003", TRACKER]


# -- the launcher ------------------------------------------------------------------------------
def launch(args) -> dict:
    """``run_rank`` on this rank: its loss rows, the CheckpointError it raised, and the warnings logged."""

    from megatron_zb.pretrain_gpt import run_rank
    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.training.checkpoint import CheckpointError

    destroy_model_parallel()  # the API tests' parallel state
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("megatron_zb.train")
    logger.addHandler(handler)
    try:
        rows = run_rank(args, torch.device("cpu"), gloo=True)
        return {"losses": {r["iteration"]: r["loss"] for r in rows if r["loss"] is not None}, "warnings": warnings}
    except CheckpointError as error:
        return {"error": str(error), "warnings": warnings}
    finally:
        logger.removeHandler(handler)


def refusal(argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(f"{MODEL} {argv}".split())
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(pool: WorkerPool, tmp_path_factory) -> dict:
    """4 iterations saved at 2 and 4 (metrics of 1-4), started with --load of a folder that does not exist."""
    root = tmp_path_factory.mktemp("launched")
    saved, missing = root / "saved", root / "no-such-folder"
    args = parse(f"{MODEL} --train-iters 4 --save-interval 2 --save {saved} --load {missing}".split())
    args.metrics_file = str(root / "run.jsonl")
    results = pool.run(launch, args=args)
    return {"root": root, "saved": saved, "missing": missing, "results": results}


def test_load_of_a_missing_folder_warns_and_trains_from_scratch(trained: dict, capsys) -> None:
    results = trained["results"]
    assert results[0]["warnings"] == [
        f"--load {trained['missing']}: every rank: no checkpoint in {trained['missing']}: the directory does not "
        f"exist; training starts from iteration 0"
    ]
    assert all(not r["warnings"] for r in results[1:]), "rank 0 warns once"
    assert sorted(results[2]["losses"]) == [1, 2, 3, 4]
    err = refusal(f"--train-iters 4 --load {trained['missing']} --exit-on-missing-checkpoint", capsys)
    assert err == (
        f"megatron-zb train: error: --load {trained['missing']}: no checkpoint in {trained['missing']}: the "
        f"directory does not exist; --exit-on-missing-checkpoint makes that an error (drop the flag to start from "
        f"scratch)\n"
    )
    assert not trained["missing"].exists()


def test_missing_rank_file_stops_every_rank_and_keeps_older_checkpoints(
    pool: WorkerPool, trained: dict, tmp_path: Path, capsys
) -> None:
    folder = tmp_path / "saved"
    shutil.copytree(trained["saved"], folder)
    args = parse(f"{MODEL} --train-iters 6 --load {folder} --save {folder}".split())  # before the damage
    missing = folder / "iter_0000004" / RANK_FILE
    missing.unlink()
    before = snapshot(folder)
    err = refusal(f"--train-iters 6 --load {folder} --save {folder}", capsys)  # refused before spawn
    assert err.startswith(f"megatron-zb train: error: --load {folder}: checkpoint file {missing} is missing")
    results = pool.run(launch, args=args)  # past the launcher's check: the ranks decide together
    for rank, result in enumerate(results):
        assert "losses" not in result, f"rank {rank} trained"
        assert result["error"].startswith("ranks 0, 2, 3: checkpoint file " + str(missing) + " is missing"), result
    assert snapshot(folder) == before, "nothing was written"


def test_resume_drops_repeated_metrics_and_is_exact(pool: WorkerPool, trained: dict, tmp_path: Path) -> None:
    """Back to the checkpoint of 2 (as if 3-4 had not been saved): 3-4 again, each once in the metrics."""
    folder, metrics = tmp_path / "saved", tmp_path / "run.jsonl"
    shutil.copytree(trained["saved"], folder)
    shutil.copyfile(trained["root"] / "run.jsonl", metrics)
    (folder / TRACKER).write_text("2\n")
    iter_2 = snapshot(folder / "iter_0000002")
    args = parse(f"{MODEL} --train-iters 4 --load {folder} --save {folder} --metrics-file {metrics}".split())
    results = pool.run(launch, args=args)
    first = trained["results"][2]["losses"]
    assert results[2]["losses"] == {3: first[3], 4: first[4]}, "bit-exact after the resume"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    assert [row["loss"] for row in rows] == [first[i] for i in (1, 2, 3, 4)]
    assert (folder / TRACKER).read_text() == "4\n" and snapshot(folder / "iter_0000002") == iter_2


def test_layout_mismatch_and_foreign_save_are_refused_before_spawn(trained: dict, capsys) -> None:
    saved = trained["saved"]
    err = refusal(f"--train-iters 6 --load {saved} --tensor-model-parallel-size 2", capsys)
    assert err.startswith(f"megatron-zb train: error: --load {saved}: iter_0000004 was saved with another layout (")
    assert "--tensor-model-parallel-size: checkpoint 1, this run 2" in err and "data-parallel size" in err
    err = refusal(f"--train-iters 6 --load {saved} --pipeline-schedule zb-v", capsys)
    assert "chunks per rank (--pipeline-schedule / --virtual-pipeline-model-parallel-size): checkpoint 1" in err
    assert "--pipeline-schedule: the checkpoint holds the linear pp=2 chunks=1 placement (1f1b)" in err
    err = refusal(f"--train-iters 4 --save {saved}", capsys)
    assert err == (
        f"megatron-zb train: error: --save {saved} holds checkpoints of iterations 4 that this run did not load: it "
        f"resumes from no checkpoint (a fresh run) and would save from iteration 4 on, over or behind them; resume "
        f"with --load {saved}, or give --save an empty folder\n"
    )
    err = refusal(f"--train-iters 6 --save-interval 2 --save {saved}", capsys)
    assert "holds checkpoints of iterations 2, 4 that this run did not load" in err
    err = refusal("--train-iters 4 --exit-on-missing-checkpoint", capsys)
    assert err == "megatron-zb train: error: --exit-on-missing-checkpoint needs --load DIRECTORY\n"
    parse(f"{MODEL} --train-iters 6 --load {saved} --save {saved}".split())  # resuming from it: accepted
    assert capsys.readouterr().err == ""


def test_summary_counts_a_resumed_iteration_once(tmp_path: Path) -> None:
    rows = [(1, 5.0), (2, 4.0), (3, 3.5), (2, 4.0), (3, 3.0), (4, 2.5)]  # 3 logged, then resumed from 2
    path = tmp_path / "run.jsonl"
    path.write_text(
        "".join(
            json.dumps({"iteration": i, "loss": loss, "iteration_time_s": 0.1, "schedule": "zb-v"}) + "\n"
            for i, loss in rows
        )
    )
    assert [(r["iteration"], r["loss"]) for r in summary.read_rows(path)] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.5)]
    line = summary.summarize([path]).splitlines()[1]
    assert line.split()[:4] == ["zb-v", "4", "5.0000", "2.5000"]
