"""Resuming from a checkpoint continues a run bit for bit.

Four gloo processes (pp=2 x dp=2) train a megatron-core GPT with DDP, megatron-core's
optimizer (plain or distributed, fp32 or bf16 with fp32 main params) and a warmup+cosine
scheduler, with dropout on so the RNG state matters. Run A trains 4 iterations and saves
after 2; run B rebuilds everything and loads; run C rebuilds, trains on other data and
perturbs the weights before loading. B and C must reproduce A's iterations 3-4 exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.checkpoint import MANIFEST, TRACKER, CheckpointMissing, load_checkpoint

M = 4
CASES = {
    "zb-h1/plain/fp32": ("zb-h1", False, torch.float32),
    "1f1b/plain/bf16": ("1f1b", False, torch.bfloat16),
    "zb-v/distributed/bf16": ("zb-v", True, torch.bfloat16),
    "zb-h1/distributed/fp32": ("zb-h1", True, torch.float32),
}


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


class Run:
    """Model chunks, optimizer and scheduler on this rank, built as for a fresh run."""

    def __init__(self, name: str, distributed: bool, dtype: torch.dtype):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_zb.runtime import ForwardBackward
        from megatron_zb.testing.parallel import init_parallel
        from megatron_zb.testing.toy_gpt import ToyGPT

        init_parallel(pp=2)
        self.runner = ForwardBackward(name, timeout_s=60)
        schedule = self.runner.schedule_for(2, M)
        self.toy = ToyGPT(dtype=dtype)
        config = self.toy.config(2, schedule.chunks, hidden_dropout=0.1)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, bucket_size=4000
        )
        # Casting whole chunks to bf16 is what megatron's Float16Module does (norms included); the
        # optimizer then keeps fp32 main params. Inputs are token ids and the loss is taken in fp32.
        chunks = [chunk.to(dtype) for chunk in self.toy.chunks(config, schedule, rank)]
        self.chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
        config.no_sync_func = [chunk.no_sync for chunk in self.chunks]
        config.finalize_model_grads_func = finalize_model_grads
        bf16 = dtype == torch.bfloat16
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=1e-4,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
        )
        self.optimizer = get_megatron_optimizer(optimizer_config, self.chunks)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=1e-3,
            min_lr=1e-4,
            lr_warmup_steps=2,
            lr_decay_steps=6,
            lr_decay_style="cosine",
            start_wd=0.01,
            end_wd=0.01,
            wd_incr_steps=6,
            wd_incr_style="constant",
        )
        torch.manual_seed(7 + torch.distributed.get_rank())  # dropout differs per rank, as its RNG state must

    def train(self, iteration: int) -> list[float]:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = self.toy.batches(M, stream=1000 * iteration + self.dp_rank)
        losses = self.toy.step(self.runner, self.chunks, batches)
        ok, _, _ = self.optimizer.step()
        assert ok, "optimizer step skipped"
        self.scheduler.step(increment=1)
        return [d["lm loss"][0].item() for d in losses]

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for chunk in self.chunks for p in chunk.parameters()]

    def perturb(self) -> None:
        with torch.no_grad():
            for chunk in self.chunks:
                for p in chunk.parameters():
                    p.add_(torch.randn_like(p) * 0.01)


def train_and_resume(directory: str, name: str, distributed: bool, dtype: torch.dtype) -> dict:
    from megatron_zb.training.checkpoint import load_checkpoint, save_checkpoint

    a = Run(name, distributed, dtype)
    losses = {}
    for iteration in (1, 2):
        losses[iteration] = a.train(iteration)
    save_checkpoint(directory, 2, a.chunks, a.optimizer, a.scheduler, extra={"schedule": name})
    expected = [a.train(3), a.train(4)]
    final = a.params()

    results = {"expected": expected}
    for variant in ("fresh", "dirty"):
        b = Run(name, distributed, dtype)
        if variant == "dirty":
            b.train(99)
            b.perturb()
        loaded = load_checkpoint(directory, b.chunks, b.optimizer, b.scheduler)
        got = [b.train(3), b.train(4)]
        equal = [torch.equal(x, y) for x, y in zip(b.params(), final, strict=True)]
        results[variant] = {"loaded": loaded, "losses": got, "params_equal": all(equal), "params": len(equal)}
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_exact(pool, tmp_path, case):
    name, distributed, dtype = CASES[case]
    results = pool.run(train_and_resume, directory=str(tmp_path), name=name, distributed=distributed, dtype=dtype)
    assert sum(1 for r in results if r["expected"][0]) == 2, "one loss rank per pipeline"
    for rank, result in enumerate(results):
        for variant in ("fresh", "dirty"):
            got = result[variant]
            assert got["loaded"] == (2, {"schedule": name})
            assert got["losses"] == result["expected"], f"rank {rank} {variant}: losses differ after resume"
            assert got["params"] > 0 and got["params_equal"], f"rank {rank} {variant}: parameters differ after resume"
    iteration = tmp_path / "iter_0000002"
    assert (tmp_path / TRACKER).read_text().strip() == "2"
    suffixes = ["_000", "_001"] if distributed else [""]
    expected_dirs = {f"mp_rank_00_{pp:03d}{dp}" for pp in range(2) for dp in suffixes}
    assert {p.name for p in iteration.iterdir() if p.is_dir()} == expected_dirs
    assert all((iteration / d / "model_optim_rng.pt").is_file() for d in expected_dirs)
    assert sorted(p.name for p in iteration.iterdir() if p.is_file()) == [MANIFEST, "metadata.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", TRACKER]  # no temporary left


def refusals(directory: str) -> dict:
    """Messages of the errors a mismatched resume raises (pp=2 checkpoint, then other settings)."""
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    run = Run("zb-h1", False, torch.float32)
    save_checkpoint(directory, 1, run.chunks, run.optimizer, run.scheduler)
    messages = {}

    def attempt(key: str, *args, **kwargs) -> None:
        try:
            load_checkpoint(directory, *args, **kwargs)
        except CheckpointError as error:
            messages[key] = f"{type(error).__name__}: {error}"

    attempt("chunks", run.chunks * 2, None, None)
    attempt("iteration", run.chunks, None, None, iteration=7)
    init_parallel(pp=1)
    attempt("pp", run.chunks, None, None)
    return messages


def test_mismatched_resume_is_refused(pool, tmp_path):
    for messages in pool.run(refusals, directory=str(tmp_path)):
        # every rank raises the same error, decided together
        assert messages["chunks"].startswith("CheckpointError: every rank: checkpoint ")
        assert "chunks: checkpoint 1, this run 2" in messages["chunks"]
        assert messages["pp"].startswith("CheckpointError: every rank: checkpoint ")
        assert "pp: checkpoint 2, this run 1" in messages["pp"] and "dp: checkpoint 2, this run 4" in messages["pp"]
        assert messages["iteration"] == (
            f"CheckpointError: every rank: no checkpoint of iteration 7 in {tmp_path}: expected "
            f"{tmp_path / 'iter_0000007'}; complete checkpoints there: iter_0000001"
        )


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(CheckpointMissing, match="^no checkpoint in .*no-such-run: the directory does not exist$"):
        load_checkpoint(missing, [], None, None)
    Path(missing).mkdir()
    with pytest.raises(CheckpointMissing, match=f"{TRACKER} is missing and there is no iter_\\* folder"):
        load_checkpoint(missing, [], None, None)


def _manifest_of(tmp_path: Path, ep: int | None) -> None:
    """A checkpoint folder whose manifest records expert parallelism ``ep`` (None: written before ep was recorded)."""
    from megatron_zb.testing.checkpoint_folder import run_args, save
    from megatron_zb.training.manifest import _json_hash

    folder = save(tmp_path, run_args(tmp_path))
    manifest = json.loads((folder / MANIFEST).read_text())
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if ep is None:
        del body["layout"]["ep"]
    else:
        body["layout"]["ep"] = ep
    (folder / MANIFEST).write_text(json.dumps({**body, "manifest_sha256": _json_hash(body)}))


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2), (None, 2)])
def test_another_expert_parallel_size_is_refused_before_spawn(tmp_path: Path, saved, resumed: int) -> None:
    """Each ep rank's file holds its own experts: a checkpoint is not resharded to another ep (None: ep 1)."""
    from megatron_zb.testing.checkpoint_folder import run_args
    from megatron_zb.training.manifest import CheckpointError, check_before_spawn

    _manifest_of(tmp_path, saved)
    with pytest.raises(CheckpointError) as refused:
        check_before_spawn(run_args(tmp_path, expert_model_parallel_size=resumed))
    said = str(refused.value)
    assert f"--expert-model-parallel-size: checkpoint {saved or 1}, this run {resumed}" in said, said
    assert "saved with another layout" in said and "not resharded" in said
    check_before_spawn(run_args(tmp_path, expert_model_parallel_size=saved or 1))  # the same ep loads


def test_the_ranks_refuse_another_expert_parallel_size_naming_both() -> None:
    from megatron_zb.training.checkpoint import Layout, _check_layout
    from megatron_zb.training.manifest import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        _check_layout(Layout(1, 2, 2, 1, False, ep=2), Layout(1, 2, 2, 1, False), Path("iter_0000005"))
    assert str(refused.value) == (
        "checkpoint iter_0000005 was saved with tp=1 pp=2 dp=2 ep=2 chunks=1 (plain optimizer), this run has "
        "tp=1 pp=2 dp=2 chunks=1 (plain optimizer) (ep: checkpoint 2, this run 1); resume with the same parallel "
        "sizes, chunk count and optimizer kind (checkpoints are not resharded)"
    )
