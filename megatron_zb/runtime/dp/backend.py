"""Which data-parallel backend runs a call's planned UNSHARD / RESHARD / REDUCE_GRAD actions.

Two implementations of the contract in ``base.py``: ``MegatronDDPBackend`` (megatron-core's
DistributedDataParallel and its distributed optimizer, ZeRO-1/2: what ran before these actions
existed) and ``FSDP2Backend`` (ZeRO-3 with PyTorch FSDP2, chunks wrapped by ``wrap_zero3``).
``backend_for`` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import DataParallelBackend
from .fsdp2 import FSDP2Backend, is_fsdp2_sharded
from .megatron_ddp import MegatronDDPBackend


def backend_for(config, models: Sequence[torch.nn.Module], forward_only: bool = False) -> DataParallelBackend:
    """The backend for these model chunks: FSDP2 when they are sharded with it, megatron-core DDP otherwise
    (which gathers no parameters for a forward-only call, as megatron-core's schedules)."""
    sharded = [is_fsdp2_sharded(model) for model in models]
    if all(sharded):
        return FSDP2Backend(models)
    if any(sharded):
        indices = [index for index, found in enumerate(sharded) if found]
        raise ValueError(
            f"model chunks {indices} are sharded with FSDP2 (ZeRO-3) and the others are not; wrap every chunk "
            "with megatron_zb.runtime.dp.wrap_zero3, or none"
        )
    return MegatronDDPBackend(config, models, forward_only)
