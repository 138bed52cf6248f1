"""megatron-core's DistributedDataParallel (and its distributed optimizer: ZeRO-1/2) as a backend.

Weights stay whole on every rank, so there is nothing to gather or release: ``unshard`` starts
the distributed optimizer's parameter all-gather (``config.param_sync_func``, once per chunk
and iteration; megatron-core's forward pre-hooks wait on it), ``reshard`` does nothing, and
``reduce_grad`` starts the chunk's gradient reduction exactly as megatron-core's schedules do
(``config.grad_sync_func``, else ``start_grad_sync()`` with ``overlap_grad_reduce``; without
overlap ``finalize_model_grads_func`` reduces once, synchronously, at the end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...schedule.lower import DataParallel
from .base import DataParallelPlanError, Handle, Ready
from .replicas import sum_replica_grads, sum_replica_router_counts


def _per_chunk(hook, chunk: int):
    return hook[chunk] if isinstance(hook, list) else hook


class MegatronDDPBackend:
    """ZeRO-1/2 and plain data parallelism through megatron-core's DDP chunks and config hooks."""

    def __init__(self, config, models: Sequence[torch.nn.Module], forward_only: bool = False):
        self.config = config
        self.models = list(models)
        # Forward-only (evaluation) gathers no parameters, as megatron-core's schedules drop param_sync_func then:
        # Megatron-LM's evaluate() turns off the forward pre-hooks that would wait for the gather, and a gather
        # left pending fails the next one (param_and_grad_buffer: assert self.param_gather_handle is None).
        self.forward_only = forward_only
        # With --overlap-param-gather, each chunk's parameter all-gather before its first pass.
        self.lowering = DataParallel(gather="once" if config.param_sync_func is not None else "none")
        self._param_synced: set[int] = set()
        self._reduced: set[int] = set()
        self.replica_groups: dict = {}  # chunk -> the group of its two copies' ranks (set by the runtime)

    def unshard(self, chunk: int) -> Handle:
        # The distributed optimizer's all-gather of updated parameters, once per iteration: a
        # chunk gathered again later in the iteration (breadth-first's backward window) already has them.
        sync = None if self.forward_only else self.config.param_sync_func
        if sync is not None and chunk not in self._param_synced:
            _per_chunk(sync, chunk)(self.models[chunk].parameters())
        self._param_synced.add(chunk)
        return Ready()

    def wait_unsharded(self, chunk: int, user: str = "a pass") -> None:
        return None  # megatron-core's forward pre-hooks wait for the parameter all-gather

    def reshard(self, chunk: int) -> None:
        return None  # weights are whole on every data-parallel rank

    def reduce_grad(self, chunk: int) -> None:
        if chunk in self._reduced:
            raise DataParallelPlanError(
                f"REDUCE_GRAD of chunk {chunk} twice in one iteration: megatron-core DDP reduces each chunk's "
                "gradient buffer once per iteration; plan one REDUCE_GRAD after the chunk's last W"
            )
        self._reduced.add(chunk)
        sync = self.config.grad_sync_func
        if sync is not None:
            _per_chunk(sync, chunk)(self.models[chunk].parameters())
            return
        ddp_config = getattr(self.models[chunk], "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_grad_reduce:
            self.models[chunk].start_grad_sync()

    def replica_sync(self, chunk: int) -> None:
        if chunk in self._reduced:
            raise DataParallelPlanError(
                f"REPLICA_SYNC of chunk {chunk} after its REDUCE_GRAD: the copies' gradients must be summed before the "
                "data-parallel reduction starts"
            )
        group = self.replica_groups.get(chunk)
        if group is None:
            raise DataParallelPlanError(f"REPLICA_SYNC of chunk {chunk}: no other copy of its block is known")
        sum_replica_grads(self.models[chunk], group)
        sum_replica_router_counts(self.models[chunk], group)  # the expert bias's, counted by each copy

    def finish(self) -> None:
        self._param_synced.clear()
        self._reduced.clear()
