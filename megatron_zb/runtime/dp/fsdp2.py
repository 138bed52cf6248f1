"""ZeRO-3 through PyTorch FSDP2 (``fully_shard``), driven by the planned UNSHARD / RESHARD / REDUCE_GRAD.

FSDP2 gathers and reduces from module hooks: gather before a forward, release after it, and
reduce-scatter when backward has passed the module. With B and W split the last one is
wrong: B ends before W has added the weight gradients. So the chunks run with FSDP2's
automatic work off (no reshard after forward or backward, no gradient sync), and this
backend calls FSDP2's own operations where the plan says: ``unshard(async_op=True)`` on
UNSHARD, ``reshard()`` on RESHARD, and on REDUCE_GRAD the parameter groups' post-backward
with gradient sync on, which reduce-scatters the gradients accumulated in the unsharded
parameters' ``.grad`` (B and every W) into the sharded gradients the optimizer steps on.
The unsharded parameter objects outlive RESHARD (only their storage is freed), so W may
run, and gradients keep accumulating, while the weights are released.

Three private pieces of FSDP2 are used, as PyTorch's own pipelining runtime uses them
(``stage.py`` ``perform_reduce_grad``): the parameter groups of an FSDP state, their
``post_backward()``, and the root state's ``_root_post_backward_final_callback()``.
``missing_fsdp2_features()`` names whatever this torch lacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ...schedule.lower import DataParallel
from .base import DataParallelPlanError, Handle

SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"
PUBLIC_METHODS = (
    "unshard",  # async_op=True returns a handle (PyTorch >= 2.4)
    "reshard",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",  # PyTorch >= 2.7
    "set_is_last_backward",
    "_get_fsdp_state",
)


def missing_fsdp2_features() -> list[str]:
    """What this torch lacks of the FSDP2 API the ZeRO-3 backend uses (empty: all there)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return ["torch.distributed.fsdp.FSDPModule (fully_shard; PyTorch >= 2.6)"]
    missing = [f"FSDPModule.{name}" for name in PUBLIC_METHODS if not hasattr(FSDPModule, name)]
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return [*missing, "torch.distributed.fsdp._fully_shard (FSDPParamGroup, FSDPState)"]
    for owner, name in (
        (FSDPParamGroup, "post_backward"),
        (FSDPParamGroup, "is_sharded"),
        (FSDPState, "_root_post_backward_final_callback"),
    ):
        if not hasattr(owner, name):
            missing.append(f"{owner.__name__}.{name}")
    return missing


def require_fsdp2() -> None:
    missing = missing_fsdp2_features()
    if missing:
        raise RuntimeError(
            f"ZeRO-3 runs on PyTorch FSDP2, and torch {torch.__version__} lacks {', '.join(missing)}; "
            "use PyTorch >= 2.7 (tested with 2.13), or the distributed optimizer (ZeRO-1/2) instead"
        )


def fsdp2_modules(model: torch.nn.Module) -> list:
    """The FSDP2-sharded modules inside ``model``, outermost (the root) first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def is_fsdp2_sharded(model: torch.nn.Module) -> bool:
    return bool(fsdp2_modules(model))


def _param_groups(module) -> list:
    """The FSDP parameter groups of one FSDP module (one per mesh; torch before 2.11 has one at most)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _unsharded_params(module) -> list[torch.nn.Parameter]:
    """The unsharded parameter objects (they exist from the first gather on)."""
    found = []
    for group in _param_groups(module):
        for fsdp_param in group.fsdp_params:
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None:
                found.append(param)
    return found


def _unreduced(module) -> bool:
    """Whether gradients wait in the unsharded parameters for a reduction."""
    for group in _param_groups(module):
        for fsdp_param in group.fsdp_params:
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None and param.grad is not None:
                return True
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                return True
    return False


class _ChunkHandle:
    def __init__(self, backend: FSDP2Backend, chunk: int):
        self.backend, self.chunk = backend, chunk

    def wait(self) -> None:
        self.backend.wait_unsharded(self.chunk, "the handle")


class FSDP2Backend:
    """ZeRO-3: each chunk's weights gathered on UNSHARD, released on RESHARD, gradients reduce-scattered on REDUCE_GRAD.

    ``models`` are this rank's chunks in chunk order, each holding FSDP2-sharded modules
    (``wrap_zero3``: one FSDP2 group per chunk). A chunk sharded per layer, as megatron-core's
    ``TorchFullyShardedDataParallel`` does, has every FSDP module gathered and released
    together (gather and release measured on CPU; training so sharded is not tested).
    """

    def __init__(self, models: Sequence[torch.nn.Module], prefetch: int = 1):
        require_fsdp2()
        self.models = list(models)
        # a gather window per run of a chunk's passes, issued ``prefetch`` compute passes ahead
        self.lowering = DataParallel(gather="windows", prefetch=prefetch)
        self._fsdp = [fsdp2_modules(model) for model in self.models]
        for chunk, modules in enumerate(self._fsdp):
            if not modules:
                raise ValueError(f"model chunk {chunk} is not sharded with FSDP2; wrap it with wrap_zero3")
            self._take_over(chunk, modules[0])
        self._pending: dict[int, list] = {}
        self._gathered: set[int] = set()
        self._touched: set[int] = set()
        self.actions: list[tuple[str, int]] = []  # this iteration's (action, chunk), in order
        self.last_actions: list[tuple[str, int]] = []  # the previous iteration's, kept by finish()

    def _take_over(self, chunk: int, root) -> None:
        """Turn FSDP2's hook-driven work off: the plan gathers, releases and reduces."""
        root.set_reshard_after_forward(False)
        root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)
        root.set_is_last_backward(False)
        if root._get_fsdp_state()._is_root is False:
            raise ValueError(
                f"model chunk {chunk}'s outermost FSDP module is not an FSDP root; shard each chunk on its own "
                "(wrap_zero3 per chunk), not a module that holds several chunks"
            )
        for module in self._fsdp[chunk]:
            if not all(group.is_sharded for group in _param_groups(module)):
                raise DataParallelPlanError(
                    f"model chunk {chunk}'s weights are gathered at the start of the iteration (left gathered by a "
                    "previous call); the optimizer steps the shards, so they must be released after each iteration"
                )

    # -- the actions --------------------------------------------------------------------------
    def unshard(self, chunk: int) -> Handle:
        state = self.state(chunk)
        if state != SHARDED:
            raise DataParallelPlanError(
                f"UNSHARD of chunk {chunk} while its weights are already {state}; plan a RESHARD between two gathers"
            )
        self._pending[chunk] = [module.unshard(async_op=True) for module in self._fsdp[chunk]]
        self._touched.add(chunk)
        self.actions.append(("UNSHARD", chunk))
        return _ChunkHandle(self, chunk)

    def wait_unsharded(self, chunk: int, user: str = "a pass") -> None:
        handles = self._pending.pop(chunk, None)
        if handles is not None:
            for handle in handles:
                handle.wait()
            self._gathered.add(chunk)
            return
        if chunk not in self._gathered:
            raise DataParallelPlanError(
                f"{user} computes on chunk {chunk} while its weights are sharded: the plan has no UNSHARD of "
                f"chunk {chunk} before it (since the iteration began or since the chunk's last RESHARD)"
            )

    def reshard(self, chunk: int) -> None:
        if chunk in self._pending:
            raise DataParallelPlanError(
                f"RESHARD of chunk {chunk} right after its UNSHARD, with no pass in between: a gather nothing used"
            )
        if chunk not in self._gathered:
            raise DataParallelPlanError(f"RESHARD of chunk {chunk}, whose weights are not gathered")
        for module in reversed(self._fsdp[chunk]):
            module.reshard()
        self._gathered.discard(chunk)
        self.actions.append(("RESHARD", chunk))

    def reduce_grad(self, chunk: int) -> None:
        """Reduce-scatter what the chunk accumulated since its last reduction into the sharded gradients.

        More than one per iteration is allowed (Fast-LLM's depth-first groups): FSDP2 adds each
        reduction to the sharded gradient.
        """
        root = self._fsdp[chunk][0]
        self._touched.add(chunk)
        self.actions.append(("REDUCE_GRAD", chunk))
        if root._get_fsdp_state()._is_root is None:
            return  # FSDP2 initialises a root at its first forward: no forward, no gradients
        root.set_requires_gradient_sync(True)
        try:
            for module in self._fsdp[chunk]:
                for group in _param_groups(module):
                    group.post_backward()
        finally:
            root.set_requires_gradient_sync(False)

    def finish(self) -> None:
        """Check that every chunk is released and reduced, then let FSDP2 wait for its reductions."""
        for chunk in range(len(self.models)):
            state = self.state(chunk)
            if state != SHARDED:
                raise DataParallelPlanError(
                    f"chunk {chunk}'s weights are still {state} at the end of the iteration: the optimizer steps the "
                    "shards, so the plan must RESHARD every chunk after its last use"
                )
            if any(_unreduced(module) for module in self._fsdp[chunk]):
                raise DataParallelPlanError(
                    f"chunk {chunk} holds gradients that no REDUCE_GRAD reduced: plan a REDUCE_GRAD after its last W"
                )
        for chunk in sorted(self._touched):
            root = self._fsdp[chunk][0]
            if root._get_fsdp_state()._is_root is None:
                continue  # never ran a forward: FSDP2 has no per-iteration state to finalise
            root.set_is_last_backward(True)
            try:
                root._get_fsdp_state()._root_post_backward_final_callback()
            finally:
                root.set_is_last_backward(False)
        self._touched.clear()
        self.last_actions, self.actions = self.actions, []

    # -- what tests and traces look at ----------------------------------------------------------
    def state(self, chunk: int) -> str:
        """``sharded``, ``gathering`` (UNSHARD issued, not yet waited on) or ``gathered``."""
        if chunk in self._pending:
            return GATHERING
        return GATHERED if chunk in self._gathered else SHARDED

    def gathered_bytes(self, chunk: int) -> int:
        """Bytes of the chunk's unsharded weights held now (0 once released)."""
        return sum(p.untyped_storage().nbytes() for module in self._fsdp[chunk] for p in _unsharded_params(module))

    def unreduced_grad_bytes(self, chunk: int) -> int:
        """Bytes of unsharded gradients accumulated and not yet reduced."""
        return sum(
            p.grad.untyped_storage().nbytes()
            for module in self._fsdp[chunk]
            for p in _unsharded_params(module)
            if p.grad is not None
        )

    def replica_sync(self, chunk: int) -> None:
        raise DataParallelPlanError(
            f"REPLICA_SYNC of chunk {chunk}: ZeRO-3 (FSDP2) does not run schedules that keep two copies of a block "
            "(BitPipe); use the distributed optimizer"
        )

    def counts(self, iteration: str = "last") -> Counter:
        """How often each (action, chunk) ran in the last finished iteration (``"current"``: this one)."""
        return Counter(self.last_actions if iteration == "last" else self.actions)
