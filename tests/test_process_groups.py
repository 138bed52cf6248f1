"""Re-initialising megatron-core's parallel state in one process keeps its thread count flat.

megatron-core's own destroy_model_parallel() leaves every group's gloo threads running (the
control below); megatron_zb.process_groups.destroy_model_parallel() destroys the groups too.
"""

from __future__ import annotations

import os

import pytest

from megatron_zb.testing.pool import WorkerPool

SIZES = [(1, 4), (2, 2), (1, 2), (4, 1)]  # (tensor, pipeline) parallel sizes, cycled
CYCLES = 2


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def reinitialise(ours: bool) -> dict:
    """Initialise, use every kind of group, destroy: CYCLES x SIZES times after a warm-up; threads after each."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.process_groups import destroy_model_parallel, destroy_process_groups, process_group_count

    destroy_model_parallel()
    found = {"after": [], "groups": []}
    for tp, pp in [SIZES[0], *SIZES * CYCLES]:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        for group in (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_pipeline_model_parallel_group(),
            parallel_state.get_data_parallel_group(),
            parallel_state.get_data_parallel_group_gloo(),
        ):
            dist.all_reduce(torch.ones(1), group=group)
        if "start" not in found:  # threads started once per process (torch's pools, WORLD's gloo) are not the point
            destroy_model_parallel()
            found["start"] = threads()
            continue
        if ours:
            destroy_model_parallel()
        else:
            parallel_state.destroy_model_parallel()
        found["after"].append(threads())
        found["groups"].append(process_group_count())
    found["cleaned"] = destroy_process_groups()
    found["end"] = threads()
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_destroying_the_groups_keeps_threads_flat(pool: WorkerPool) -> None:
    for rank, found in enumerate(pool.run(reinitialise, ours=True)):
        assert found["groups"] == [1] * len(SIZES) * CYCLES, (rank, found)
        assert found["cleaned"] == 0, (rank, found)
        assert max(found["after"]) == found["start"], (rank, found)
        assert found["after"][-1] == found["after"][len(SIZES) - 1], (rank, found)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_megatron_core_alone_leaves_the_groups_running(pool: WorkerPool) -> None:
    """The control: the count does grow without destroying the groups, and destroying them later frees it."""
    for rank, found in enumerate(pool.run(reinitialise, ours=False)):
        assert found["after"] == sorted(found["after"]) and found["after"][-1] > found["after"][0] + 10, (rank, found)
        assert found["groups"][-1] > found["groups"][0] > 1, (rank, found)
        assert found["cleaned"] == found["groups"][-1] - 1, (rank, found)
        assert found["end"] == found["start"], (rank, found)
