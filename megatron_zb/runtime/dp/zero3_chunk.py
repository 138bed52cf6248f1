"""The model-building side of ZeRO-3: a megatron-core chunk sharded with PyTorch FSDP2, and its optimizer.

megatron-core ships ``TorchFullyShardedDataParallel`` (FSDP2 per transformer layer), but it
builds its device mesh for ``"cuda"`` whatever the parameters' device, so it cannot run on
CPU; ``Zero3Chunk`` shards the same way from the parameters' own device. Each chunk is one
FSDP2 parameter group: the plan gathers and releases a chunk as a whole, so one collective
per chunk is what the schedule costs. The wrapper is a megatron-core ``_BaseDataParallel``,
so ``get_megatron_optimizer`` and ``finalize_model_grads`` take it like a DDP chunk; the
optimizer steps the sharded (DTensor) parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fsdp2 import require_fsdp2


def _refuse_unsupported(config) -> None:
    refused = {
        "gradient_accumulation_fusion": "FSDP2 parameters have no main_grad to accumulate into; turn "
        "gradient_accumulation_fusion off (--no-gradient-accumulation-fusion)",
        "calculate_per_token_loss": "FSDP2 averages gradients over data-parallel ranks before megatron-core's "
        "per-token scaling; turn calculate_per_token_loss off",
        "delay_wgrad_compute": "Transformer Engine's delayed weight gradients go to main_grad, which FSDP2 "
        "parameters do not have; turn delay_wgrad_compute off",
    }
    for name, why in refused.items():
        if getattr(config, name, False):
            raise ValueError(f"ZeRO-3 (FSDP2) does not support {name}: {why}")


def _ddp_config():
    """The config megatron-core's optimizer reads from a chunk (``use_megatron_fsdp`` off, no buffers)."""
    try:
        from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
            TorchFullyShardedDataParallelConfig as Config,
        )
    except ImportError:
        from megatron.core.distributed import DistributedDataParallelConfig as Config
    config = Config()
    if hasattr(config, "reshard_after_forward"):
        config.reshard_after_forward = False  # the plan releases weights, not FSDP2's hooks
    return config


def _megatron_param_attributes(module: torch.nn.Module) -> dict[str, dict]:
    """megatron-core's attributes on each parameter (fully_shard replaces the parameter objects)."""
    return {name: dict(vars(param)) for name, param in module.named_parameters()}


def _restore(module: torch.nn.Module, attributes: dict[str, dict]) -> None:
    for name, param in module.named_parameters():
        for key, value in attributes.get(name, {}).items():
            setattr(param, key, value)


def _base_class():
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    return _BaseDataParallel


class Zero3Chunk(_base_class()):
    """A megatron-core model chunk whose parameters, gradients and optimizer state are sharded (FSDP2).

    ``process_group`` is the data-parallel group to shard over (default: megatron-core's,
    with context parallelism, as its own FSDP wrappers use). Use it as a DDP chunk: the
    runtime's ``FSDP2Backend`` gathers, releases and reduces it where the plan says.
    """

    def __init__(self, config, module: torch.nn.Module, process_group=None):
        require_fsdp2()
        _refuse_unsupported(config)
        super().__init__(config=config, module=module)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if process_group is None:
            from megatron.core import parallel_state

            process_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.process_group = process_group
        self.ddp_config = _ddp_config()
        device = next(module.parameters()).device
        # Meshes compare equal by ranks and dimension names, not by group, and DTensor reuses an equal
        # mesh it has seen: a mesh over the same ranks from an earlier, destroyed group would resolve a
        # group that no longer exists. Naming the dimension after the group keeps each mesh its own.
        mesh = DeviceMesh.from_group(process_group, device.type, mesh_dim_names=(f"dp{process_group.group_name}",))
        attributes = _megatron_param_attributes(module)
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        _restore(module, attributes)

    def finish_grad_sync(self, *args, **kwargs) -> None:
        """Nothing left to wait for: the backend's ``finish()`` did (REDUCE_GRAD ran FSDP2's reduction).

        Overridden because megatron-core 0.16.1's ``finalize_model_grads`` passes
        ``force_all_reduce=`` that its ``_BaseDataParallel.finish_grad_sync`` does not take.
        """

    def zero_grad_buffer(self) -> None:
        """Drop the sharded gradients (megatron-core's training loop calls this every iteration)."""
        for param in self.module.parameters():
            param.grad = None

    def scale_gradients(self, scaling_factor: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)


def wrap_zero3(config, chunks: Sequence[torch.nn.Module], process_group=None) -> list[Zero3Chunk]:
    """Shard each of this rank's model chunks with FSDP2 (build the optimizer afterwards, on the shards)."""
    return [Zero3Chunk(config, chunk, process_group) for chunk in chunks]


def zero3_optimizer(optimizer_config, chunks: Sequence[Zero3Chunk]):
    """megatron-core's optimizer over the sharded parameters (``get_megatron_optimizer`` takes DTensors).

    The distributed optimizer is refused: ZeRO-3 already shards the optimizer state, and
    megatron-core's distributed optimizer needs DDP's contiguous gradient buffers.
    """
    if getattr(optimizer_config, "use_distributed_optimizer", False):
        raise ValueError(
            "ZeRO-3 (FSDP2) shards parameters, gradients and optimizer state already; turn "
            "use_distributed_optimizer off (--use-distributed-optimizer is for ZeRO-1/2 with DDP)"
        )
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(optimizer_config, list(chunks))
