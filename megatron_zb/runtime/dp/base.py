"""The data-parallel backend the executor drives with the planned UNSHARD / RESHARD / REDUCE_GRAD actions.

One object per ``forward_backward`` call, one method per action, addressed by the chunk index
the schedule uses. The executor calls ``unshard`` where the plan gathers a chunk's weights
(ahead of their use: prefetch), ``wait_unsharded`` before every F, B and BW on the chunk
(only the first call after an ``unshard`` waits), ``reshard`` where the plan releases them,
``reduce_grad`` after the chunk's last W, and ``finish`` once every pass has run, before
``finalize_model_grads_func``. W needs no gathered weights: it only adds to gradients.

This module is the contract alone, so that the implementations (``fsdp2.py``,
``megatron_ddp.py``) import it and ``backend.py``, which chooses among them, imports them.
"""

from __future__ import annotations

from typing import Protocol

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
