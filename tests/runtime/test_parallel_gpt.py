"""Schedules with tensor and data parallelism: megatron-core DDP (overlap on and off, the
distributed optimizer's reduce-scatter) and TP collectives inside B and W.

Four gloo processes: pp=2 x tp=2, or pp=2 x dp=2. The reference is the same blocks chained
unpipelined (with tp=2 every tensor-parallel rank runs its shard of it; with dp=2 it runs
both replicas' microbatches, which is what DDP's averaged gradient equals).
"""

from __future__ import annotations

import pytest

from megatron_zb.schedule import ScheduleError, ScheduleSpec, build, names
from megatron_zb.testing.pool import WorkerPool
from megatron_zb.testing.shapes import one_per_shape

TOLERANCE = 1e-5
M = 5  # 2p+1 for pp=2
DDP_VARIANTS = {
    "ddp": dict(overlap_grad_reduce=False, use_distributed_optimizer=False),
    "ddp-overlap": dict(overlap_grad_reduce=True, use_distributed_optimizer=False),
    "distopt-overlap": dict(overlap_grad_reduce=True, use_distributed_optimizer=True),
    "distopt": dict(overlap_grad_reduce=False, use_distributed_optimizer=True),
}
WITH_GRAD_SYNC_FUNC = "ddp-overlap+grad_sync_func"  # how Megatron-LM wires overlap with align_grad_reduce


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def run_parallel(
    name: str, tp: int, ddp: dict | None, m: int = M, iterations: int = 2, grad_sync_func: bool = False
) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.parallel import compare_to_blocks, init_parallel, reduced_slices
    from megatron_zb.testing.toy_gpt import ToyGPT, reference_step

    pp = 2
    init_parallel(tp=tp, pp=pp)
    runner = ForwardBackward(name, timeout_s=60)
    schedule = runner.schedule_for(pp, m)
    toy = ToyGPT()
    config = toy.config(pp, schedule.chunks, tp)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    chunks = toy.chunks(config, schedule, rank)
    if ddp is not None:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=4000, **ddp)
        chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        syncs = _record_grad_syncs(chunks, runner)
        if grad_sync_func:
            config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
    batches = toy.batches(m, stream=dp_rank)
    for _ in range(iterations):  # the second iteration checks that DDP's per-iteration state resets
        for chunk in chunks:
            if ddp is not None:
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)
        losses = toy.step(runner, chunks, batches)
    blocks = toy.all_blocks(config, schedule.placement)
    everyone = [batch for stream in range(dp_size) for batch in toy.batches(m, stream=stream)]
    reference = reference_step(blocks, everyone, num_microbatches=m * dp_size)
    slices = None
    if ddp is not None and ddp["use_distributed_optimizer"]:
        slices = {}
        for chunk in chunks:
            slices.update(reduced_slices(chunk, dp_rank, dp_size))
    worst, compared = compare_to_blocks(chunks, blocks, schedule, rank, slices)
    return {
        "losses": [float(d["lm loss"][0]) for d in losses],
        "reference": reference[dp_rank * m : (dp_rank + 1) * m],
        "worst_grad": worst,
        "compared": compared,
        "chunks": len(chunks),
        "syncs": syncs if ddp is not None else None,
    }


def _record_grad_syncs(chunks: list, runner) -> list:
    """Wrap each chunk's start_grad_sync: (chunk, W jobs of that chunk still queued) per call."""
    calls = []
    for index, chunk in enumerate(chunks):
        original = chunk.start_grad_sync

        def start(*args, _index=index, _original=original):
            pending = [key for key in runner.last_store.pending_keys() if key[0] == _index]
            calls.append((_index, len(pending)))
            return _original(*args)

        chunk.start_grad_sync = start
    return calls


def check(results: list[dict]) -> None:
    assert sum(1 for r in results if r["losses"]) == 2, "one loss rank per pipeline"
    for rank, result in enumerate(results):
        if result["losses"]:
            assert result["losses"] == pytest.approx(result["reference"], rel=TOLERANCE)
        assert result["compared"] > 0, f"rank {rank} compared no gradients"
        assert result["worst_grad"] <= TOLERANCE, f"rank {rank}: gradient differs by {result['worst_grad']:.2e}"


def runnable(name: str) -> bool:
    try:
        build(name, ScheduleSpec(2, M))
    except ScheduleError:
        return False
    return True


SCHEDULES = [name for name in names() if runnable(name)]


# With overlap the schedule decides when each chunk's reduction starts: right after its last W, where
# the lowering puts its REDUCE_GRAD (every schedule: tests/schedule/test_actions.py), and the runtime
# runs that action whatever the schedule. So one schedule of each shape runs DDP with overlap, plain
# and through Megatron-LM's grad_sync_func, and the distributed optimizer's overlapped reduce-scatter
# (it starts from the same hooks). Without overlap finalize_model_grads reduces after the schedule,
# whatever the order: one schedule runs those.
ONE_PER_SHAPE = one_per_shape(SCHEDULES, pp=2, microbatches=M)
DDP_CASES = [
    (name, variant) for name in ONE_PER_SHAPE for variant in ("ddp-overlap", WITH_GRAD_SYNC_FUNC, "distopt-overlap")
] + [("zb-v", variant) for variant in ("ddp", "distopt")]


# Tensor parallelism lives inside each pass (the collectives of B, the local weight gradients of
# W), the same on both TP ranks whatever the order: one schedule of each shape runs it.
@pytest.mark.parametrize("name", ONE_PER_SHAPE)
def test_tensor_parallel(pool, name):
    check(pool.run(run_parallel, name=name, tp=2, ddp=None))


@pytest.mark.parametrize("name, variant", DDP_CASES)
def test_data_parallel_ddp(pool, name, variant):
    with_func = variant == WITH_GRAD_SYNC_FUNC
    ddp = DDP_VARIANTS["ddp-overlap" if with_func else variant]
    results = pool.run(run_parallel, name=name, tp=1, ddp=ddp, grad_sync_func=with_func)
    check(results)
    for result in results:
        # Overlap: each chunk's reduction starts once per iteration (2 here), after its last W.
        # Without overlap, finalize_model_grads reduces synchronously and nothing starts early.
        starts = [(chunk, 0) for _ in range(2) for chunk in range(result["chunks"])]
        assert sorted(result["syncs"]) == (sorted(starts) if ddp["overlap_grad_reduce"] else [])


def test_tensor_parallel_under_ddp_overlap(pool):
    check(pool.run(run_parallel, name="zb-v", tp=2, ddp=DDP_VARIANTS["ddp-overlap"]))
