"""Nothing outlives an iteration, and ZB-H1 stays within one microbatch of 1F1B's peak memory."""

from __future__ import annotations

import pytest

from megatron_zb.testing.pool import WorkerPool


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def run_iterations(name: str, pp: int = 4, m: int = 8, iterations: int = 3) -> dict:
    """Three iterations; weakrefs to every activation and W job; memory sampled around each pass."""
    import gc
    import weakref

    import torch
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.memory import MemorySampler
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=pp)
    sampler = MemorySampler()
    runner = ForwardBackward(name, timeout_s=60, profiler=sampler)
    schedule = runner.schedule_for(pp, m)
    toy = ToyGPT(hidden=64, seq=64, micro_batch=4, heads=4)
    chunks = toy.chunks(toy.config(pp, schedule.chunks), schedule, parallel_state.get_pipeline_model_parallel_rank())
    batches = toy.batches(m)
    tracked: list[weakref.ref] = []

    def pack(tensor):
        if tensor.is_floating_point() and not isinstance(tensor, torch.nn.Parameter):  # not the caller's data
            tracked.append(weakref.ref(tensor))
        return tensor

    jobs: list[weakref.ref] = []
    peaks = []
    for _ in range(iterations):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=False)
        gc.collect()
        sampler.reset()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            toy.step(runner, chunks, batches)
        jobs += [weakref.ref(job) for job in runner.last_store.alive]
        peaks.append(sampler.peak)
    gc.collect()
    return {
        "tracked": len(tracked),
        "alive": sum(ref() is not None for ref in tracked),
        "jobs_alive": sum(ref() is not None for ref in jobs) + len(runner.last_store.alive),
        "queued": runner.last_store.queued,
        "peak": max(peaks),
        "forward_growth": sampler.forward_growth,
    }


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_no_activation_or_w_job_outlives_the_iteration(pool, name):
    for rank, result in enumerate(pool.run(run_iterations, name=name)):
        assert result["tracked"] > 100 and result["queued"] > 0, "the hooks saw the activations and W jobs"
        assert result["alive"] == 0, f"rank {rank}: {result['alive']} saved activations still referenced"
        assert result["jobs_alive"] == 0, f"rank {rank}: W jobs still referenced"


def test_zb_h1_peak_within_one_microbatch_of_1f1b(pool):
    one_f_one_b = pool.run(run_iterations, name="1f1b")
    zb_h1 = pool.run(run_iterations, name="zb-h1")
    microbatch = max(r["forward_growth"] for r in one_f_one_b)
    assert microbatch > 1_000_000, "one microbatch's activations should be measurable"
    peak_1f1b = max(r["peak"] for r in one_f_one_b)
    peak_zb_h1 = max(r["peak"] for r in zb_h1)
    assert peak_1f1b > 3 * microbatch, "1F1B holds about pp microbatches on rank 0"
    assert peak_zb_h1 <= peak_1f1b + microbatch, (peak_zb_h1, peak_1f1b, microbatch)
