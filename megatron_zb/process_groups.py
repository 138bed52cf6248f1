"""Tear megatron-core's parallel state down completely: its globals and the process groups behind them.

megatron-core's ``parallel_state.destroy_model_parallel()`` (0.16 to 0.19) only sets its globals to
None; the torch.distributed groups it created stay registered, and every gloo group keeps its
threads and sockets. A process that initialises parallel state again and again (a pooled test
worker, verify's copies, a launcher called from Python) piles them up: on 0.19, whose
``initialize_model_parallel`` creates many more groups, hundreds of gloo threads per initialise.
"""

from __future__ import annotations

import gc


def destroy_model_parallel() -> int:
    """megatron-core's ``destroy_model_parallel()``, then every process group but the default one.

    Call it on every rank once the ranks are done communicating (after the last collective, or
    after a failure): destroying a group is local, nothing is exchanged. Returns how many groups
    were destroyed. The default (WORLD) group stays up, so parallel state can be initialised again.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return destroy_process_groups()


def destroy_process_groups() -> int:
    """Destroy every torch.distributed group of this process except the default (WORLD) one; how many.

    This includes groups created beside megatron-core's (post-validation's stage and chain groups):
    whatever held them must be done with them.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    world = dist.group.WORLD
    groups = [group for group in list(dist.distributed_c10d._world.pg_map) if group is not world]
    count = len(groups)
    while groups:
        dist.destroy_process_group(groups.pop())
    # A group's threads and sockets go only with its last reference; models, optimizers and
    # runners that held it often sit in reference cycles, which only the cycle collector frees.
    gc.collect()
    return count


def process_group_count() -> int:
    """How many torch.distributed groups this process holds, the default one included (0 before init)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    return len(dist.distributed_c10d._world.pg_map)


def group_device(group):
    """Where a collective over ``group`` takes its tensors: the current GPU for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
