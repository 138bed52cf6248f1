"""What one rank's checkpoint file holds, and how it goes back: model chunks, optimizer, RNG.

``checkpoint`` decides where and when a rank writes and reads; this module only turns the live
objects into picklable CPU state and back. The distributed optimizer's state carries this
rank's shard of the fp32 main params and Adam moments, which its ``state_dict()`` leaves out.
The RNG states are per rank (different data, dropout): with the plain optimizer they are
gathered over the data-parallel group into dp rank 0's file, and each rank restores its own.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist


# -- model ------------------------------------------------------------------------------------
def model_keys(count: int) -> list[str]:
    """Megatron-LM's keys of the model chunks in a checkpoint (``model``, or ``model0``, ``model1``, ...)."""
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def model_states(chunks: list) -> dict:
    """Each chunk's state dict (Megatron-LM's ``state_dict_for_save_checkpoint`` where it has one)."""
    states = {}
    for key, chunk in zip(model_keys(len(chunks)), chunks, strict=True):
        save = getattr(chunk, "state_dict_for_save_checkpoint", chunk.state_dict)
        states[key] = cpu_copy(save())
    return states


def load_model_states(chunks: list, saved: dict) -> None:
    """Back into the chunks, strictly: a missing or extra key is an error, not a fresh weight."""
    for key, chunk in zip(model_keys(len(chunks)), chunks, strict=True):
        chunk.load_state_dict(saved[key], strict=True)


def cpu_copy(value: Any) -> Any:
    """Own CPU copies: a view into DDP's flat buffer would otherwise save the whole buffer."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(cpu_copy(v) for v in value)
    return value


# -- optimizer --------------------------------------------------------------------------------
def optimizer_parts(optimizer) -> list:
    """The sub-optimizers of a chained optimizer, or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def optimizer_state(optimizer) -> list[dict]:
    """One state dict per chained optimizer; a distributed one carries this rank's shard too."""
    states = []
    for part in optimizer_parts(optimizer):
        if is_distributed(part):
            if not part.optimizer.state:
                raise ValueError("the distributed optimizer has no state before its first step; save after training")
            state = part.state_dict()
            shard = part.get_parameter_state_dp_reshardable()
            for by_dtype in (v for k, v in shard.items() if isinstance(k, int)):
                for buckets in by_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry["padding"] = False  # load_parameter_state_from_dp_reshardable filters on it
            state["param_state"] = shard
            state["param_state_sharding_type"] = "dp_reshardable"
        else:
            state = part.state_dict()
        states.append(cpu_copy(state))
    return states


def load_optimizer(optimizer, states: list[dict]) -> None:
    parts = optimizer_parts(optimizer)
    if len(states) != len(parts):
        raise ValueError(f"checkpoint holds {len(states)} chained optimizer(s), this run has {len(parts)}")
    # no_grad: with fp32 params the distributed optimizer's main params are views of the model
    # params, and its load copies into them in place.
    with torch.no_grad():
        if hasattr(optimizer, "chained_optimizers") and len(parts) > 1:
            optimizer.load_state_dict(states)
        else:
            optimizer.load_state_dict(states[0])
    for part in parts:
        _unshare_steps(part)


def _unshare_steps(part) -> None:
    """Give each parameter its own Adam step tensor.

    The distributed optimizer's load_state_dict allocates a fresh state with one ``step``
    tensor shared by every parameter (torch Adam keeps it uncopied); each step would then
    advance it once per parameter and change the bias correction.
    """
    inner = getattr(part, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            state["step"] = step.clone()


# -- RNG --------------------------------------------------------------------------------------
def rng_state() -> dict:
    state: dict[str, Any] = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    try:
        import numpy

        state["np_rng_state"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    from megatron.core import tensor_parallel

    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    if tracker_states:
        state["rng_tracker_states"] = cpu_copy(tracker_states)
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "np_rng_state" in state:
        import numpy

        numpy.random.set_state(state["np_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if "rng_tracker_states" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def gather_rng_over_dp(rng: dict, dp_rank: int, dp_size: int, expert: bool = False) -> dict[int, dict] | None:
    """Every dp rank's RNG state, on dp rank 0 (None elsewhere).

    ``expert``: over the expert-data-parallel group (with expert parallelism, the ranks that share
    this rank's experts and so its checkpoint file); ``dp_rank``/``dp_size`` are then within it.
    """
    if dp_size == 1:
        return {0: rng}
    from megatron.core import parallel_state as ps

    try:
        if expert:
            group = ps.get_expert_data_parallel_group_gloo()
        else:
            group = ps.get_data_parallel_group_gloo(with_context_parallel=True)
    except (AssertionError, RuntimeError):
        group = None
    if group is None:
        group = (
            ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group(with_context_parallel=True)
        )
    gathered = [None] * dp_size if dp_rank == 0 else None
    dist.gather_object(rng, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return dict(enumerate(gathered)) if gathered is not None else None
