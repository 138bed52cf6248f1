"""The data-parallel backend the executor drives with the planned UNSHARD / RESHARD / REDUCE_GRAD actions.

One object per ``forward_backward`` call, one method per action, addressed by the chunk index
the schedule uses. The executor calls ``unshard`` where the plan gathers a chunk's weights
(ahead of their use: prefetch), ``wait_unsharded`` before every F, B and BW on the chunk
(only the first call after an ``unshard`` waits), ``reshard`` where the plan releases them,
``reduce_grad`` after the chunk's last W, and ``finish`` once every pass has run, before
``finalize_model_grads_func``. W needs no gathered weights: it only adds to gradients.

Two implementations: ``MegatronDDPBackend`` (megatron-core's DistributedDataParallel and its
distributed optimizer, ZeRO-1/2: what ran before these actions existed) and ``FSDP2Backend``
(ZeRO-3 with PyTorch FSDP2, chunks wrapped by ``wrap_zero3``). ``backend_for`` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ...schedule.lower import DataParallel


class DataParallelPlanError(RuntimeError):
    """The planned data-parallel actions do not fit together (a lowering bug or a hand-written order)."""


class Handle(Protocol):
    def wait(self) -> None:
        """Block until the chunk's weights can be used."""


class Ready:
    """The handle of a gather that needs no waiting (or that megatron-core waits on in its own hooks)."""

    def wait(self) -> None:
        return None


class DataParallelBackend(Protocol):
    lowering: DataParallel  # the data-parallel actions the schedule is lowered with for this backend

    def unshard(self, chunk: int) -> Handle:
        """Start gathering the chunk's weights; return at once."""

    def wait_unsharded(self, chunk: int, user: str = "a pass") -> None:
        """Before a pass computes on ``chunk`` (``user`` names it in errors): wait for its gather."""

    def reshard(self, chunk: int) -> None:
        """Release the chunk's gathered weights (its gradients stay until ``reduce_grad``)."""

    def reduce_grad(self, chunk: int) -> None:
        """Start reducing the gradients the chunk accumulated (after its last W)."""

    def replica_sync(self, chunk: int) -> None:
        """Sum the chunk's gradients with its copy's on the partner rank (``replica_groups`` set by the runtime)."""

    def finish(self) -> None:
        """End of the iteration: wait for reductions, check every action was matched, reset."""


def backend_for(config, models: Sequence[torch.nn.Module], forward_only: bool = False) -> DataParallelBackend:
    """The backend for these model chunks: FSDP2 when they are sharded with it, megatron-core DDP otherwise
    (which gathers no parameters for a forward-only call, as megatron-core's schedules)."""
    from .fsdp2 import FSDP2Backend, is_fsdp2_sharded

    sharded = [is_fsdp2_sharded(model) for model in models]
    if all(sharded):
        return FSDP2Backend(models)
    if any(sharded):
        indices = [index for index, found in enumerate(sharded) if found]
        raise ValueError(
            f"model chunks {indices} are sharded with FSDP2 (ZeRO-3) and the others are not; wrap every chunk "
            "with megatron_zb.runtime.dp.wrap_zero3, or none"
        )
    from .megatron_ddp import MegatronDDPBackend

    return MegatronDDPBackend(config, models, forward_only)
