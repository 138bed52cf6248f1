"""Asynchronous collectives and megatron-core's global memory buffer inside an overlapped F&B pair (overlap.py).

Sequence parallelism all-gathers a linear's input asynchronously in its backward, into megatron-core's global
memory buffer ("mpu"), which the forward's own all-gather uses too: a pair must issue the handle at once, let the
other side compute while it waits, and give the backward side its own buffer.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def pool(worker_pools):
    return worker_pools.get(2)


def test_async_collectives_and_buffers_of_the_two_sides(pool) -> None:
    results = pool.run(async_case)
    for rank, found in enumerate(results):
        assert found["forward"] == [3.0, 3.0] and found["backward"] == [30.0, 30.0], (rank, found)
        assert found["buffers_differ"] and found["restored"], (rank, found)
        assert found["twin_async"], (rank, found)


def async_case() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.runtime import overlap

    shared = Buffer()
    saved = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = shared
    rank = dist.get_rank()
    twins = overlap.Twins.create([None])
    pairs = overlap.Pairs(twins)
    seen: dict = {}
    original = pairs.wrapper._call

    def counted(op, call, bound, args, kwargs):
        side = getattr(overlap._side, "value", None)
        handle = original(op, call, bound, args, kwargs)
        if side is not None and side.twins is not None and bound().get("async_op"):
            seen["twin_async"] = isinstance(handle, overlap._Waiting)
        return handle

    pairs.wrapper._call = counted

    def gathered(scale: float) -> tuple[list[float], torch.Tensor]:
        """An all-gather into the buffer's "mpu" tensor, waited on after some compute, as a linear's backward does."""
        buffer = parallel_state.get_global_memory_buffer().get_tensor((2,), torch.float32, "mpu")
        handle = dist.all_gather_into_tensor(buffer, torch.tensor([scale * (rank + 1)]), async_op=True)
        torch.ones(64, 64) @ torch.ones(64, 64)
        handle.wait()
        return [float(value) for value in buffer.sum().repeat(2)], buffer

    try:
        with pairs.running():
            (forward, mine), (backward, theirs) = overlap.run_pair(
                lambda: gathered(1.0), lambda: gathered(10.0), twins, pairs.wrapper
            )
        restored = parallel_state._GLOBAL_MEMORY_BUFFER is shared
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved
    return {
        "forward": forward,
        "backward": backward,
        "buffers_differ": mine.data_ptr() != theirs.data_ptr(),
        "restored": restored,
        "twin_async": seen.get("twin_async", False),
    }


class Buffer:
    """megatron-core's GlobalMemoryBuffer on the host: one tensor per (name, dtype), reused."""

    def __init__(self):
        self.buffer: dict = {}

    def get_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
        key = (name, dtype)
        if key not in self.buffer:
            self.buffer[key] = torch.empty(shape, dtype=dtype)
        return self.buffer[key]
