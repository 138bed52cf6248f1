"""Optimizer post-validation: step without a global synchronisation, undo the rare step that was wrong.

megatron-core's optimizer step all-reduces the grad norm² and the found-inf flag over every
pipeline stage, which ends every iteration with a barrier. Here each stage reduces them
inside the stage, receives the previous stages' partial statistics, adds its own and passes
them on (``chain.py``), and steps at once, assuming what almost always holds: no inf/nan and
no clipping. When its partial statistics already show inf/nan (the step is skipped) or a
norm above the clip threshold (it waits for the full norm), it does not guess. The last stage
has the full statistics and sends them back; each stage checks them before the first backward
of the next iteration, whose warm-up forwards may run meanwhile (``ForwardBackward`` calls
``settle``). If a guess was wrong, the stage undoes its step and skips or redoes it with
clipping, and every rank discards and recomputes what it ran since (``settle`` returns True).

``PostValidation(optimizer)`` patches the instance, so Megatron-LM still sees its own
ChainedOptimizer (isinstance checks, checkpoints); ``step()`` keeps megatron-core's contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import patching
from ..compat import grads_for_grad_norm, separate_grad_norm_params
from ..runtime.forward_backward import CONFIG_ATTRIBUTE
from ..runtime.p2p import DEFAULT_TIMEOUT_S
from .chain import StatsChain
from .layout import SPECULATED, StatsLayout, build_layout
from .rollback import ExactRollback, InPlaceRollback, Rollback
from .stats import Verdict, fill_stage_slots, local_norm_sq, prepare_local, speculated, verdict
from .support import check_supported

log = logging.getLogger("megatron_zb.post_validation")
MODES = ("exact", "in-place")
SETTLED_BEFORE = ("state_dict", "sharded_state_dict", "save_parameter_state", "get_parameter_state_dp_reshardable")


@dataclass
class _Pending:
    """A step whose full statistics this rank has not checked yet."""

    step: int
    vector: torch.Tensor
    complete: bool  # the vector is the full one
    relayed: bool  # the full vector went on to the previous stage
    rollbacks: list[Rollback] | None  # set when this rank stepped on a guess
    returned_success: bool
    scheduler_increment: int | None = None


@dataclass(frozen=True)
class StepReport:
    """The validated outcome of one step (the last stage knows it at once, others one iteration later)."""

    step: int
    skipped: bool
    grad_norm: float | None
    rolled_back: bool  # this rank undid its step
    recomputed: bool  # the iteration after it was recomputed from its start


class PostValidation:
    """Post-validates ``optimizer`` (megatron-core's ChainedOptimizer) on every rank.

    ``model`` is this rank's list of model chunks: their config tells ``ForwardBackward`` where to
    check. ``pipeline_group`` is this rank's pipeline-parallel group. ``mode`` "exact" snapshots what
    the step changes; "in-place" runs Adam backwards instead (no copy of parameters or moments,
    results within rounding). Construction is collective over the default group.
    """

    def __init__(
        self,
        optimizer,
        model: list,
        pipeline_group,
        mode: str = "exact",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        scope: str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"post-validation mode {mode!r}: choose one of {', '.join(MODES)}")
        check_supported(optimizer, mode)
        separate = sum(separate_grad_norm_params(sub) for sub in optimizer.chained_optimizers)
        if separate:
            raise ValueError(
                f"post-validation reduces one grad norm; {separate} parameters (multi-token prediction) have a norm "
                "group of their own in this megatron-core: turn off --enable-optimizer-post-validation or MTP"
            )
        self.optimizer = optimizer
        self.subs = [sub for sub in optimizer.chained_optimizers]
        self.mode = mode
        self.clip_grad = optimizer.config.clip_grad
        self.device = _device(self.subs)
        scaled = [sub for sub in self.subs if getattr(sub, "grad_scaler", None)]
        self.layout: StatsLayout = build_layout(
            self.subs[0].get_grad_stats_parallel_group(), pipeline_group, len(scaled)
        )
        self.chain = StatsChain(self.layout, self.device, timeout_s)
        self.steps = 0
        self.pending: _Pending | None = None
        self.reports: list[StepReport] = []
        # The optimizer's (and the scheduler's) methods are replaced under ``scope``: close() puts them back, or
        # the owner of the scope does (Megatron-LM's: when pretrain() returns).
        self.scope = scope or f"post-validation#{id(self)}"
        patching.replace(optimizer, "step", self.step, self.scope)
        for name in SETTLED_BEFORE:  # a checkpoint holds validated parameters only
            if hasattr(optimizer, name):
                patching.replace(optimizer, name, self._settled(getattr(optimizer, name)), self.scope)
        optimizer.post_validation = self
        from megatron.core.utils import get_model_config

        for chunk in model:  # how the runtime finds this post-validation (its schedule runs the chain)
            patching.replace(get_model_config(chunk), CONFIG_ATTRIBUTE, self, self.scope)

    def _settled(self, method):
        def settled(*args, **kwargs):
            self.settle()
            return method(*args, **kwargs)

        return settled

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        """megatron-core's ``(update_successful, grad_norm, num_zeros_in_grad)``; a guess before the last stage."""
        self.settle()
        self.steps += 1
        found = [flag for flag in (prepare_local(sub, self.device) for sub in self.subs) if flag is not None]
        grads = [grad for sub in self.subs for grad in grads_for_grad_norm(sub)]
        mine = torch.zeros(self.layout.size, dtype=torch.float, device=self.device)
        fill_stage_slots(mine, self.layout, found, local_norm_sq(grads, self.device))
        received = self.chain.receive_partial(self.steps)
        # Every entry is >= 0 and each norm slot is filled by one stage only: the maximum merges them.
        vector = torch.maximum(received, mine)
        known = verdict(vector, self.layout, self.clip_grad)
        upstream_waits = verdict(received, self.layout, self.clip_grad).clip  # the previous stage waits for the norm
        guess = False
        if self.layout.last:
            complete = True
            self.chain.send_full(vector, self.steps)
        elif known.clip or upstream_waits:
            # The norm only grows along the chain: clipping (or, further on, a skip) is certain. Wait for the
            # full statistics, and relay them at once to the stages before, which wait too.
            self.chain.send_partial(vector, self.steps)
            vector, complete = self._wait_full(), True
            known = verdict(vector, self.layout, self.clip_grad)
        else:
            complete, guess = False, known.plain  # a partial inf/nan is certain: skip without guessing
            if guess and self.layout.first:
                vector[SPECULATED] = 1.0
            self.chain.send_partial(vector, self.steps)
            self.chain.post_full(self.steps)
        rollbacks = self._step(known, guess)
        if complete:
            self._update_scalers(known)
        self.pending = _Pending(self.steps, vector, complete, complete, rollbacks, not known.skip)
        return (not known.skip, known.grad_norm if complete else None, None)

    def _wait_full(self) -> torch.Tensor:
        self.chain.post_full(self.steps)
        vector = self.chain.wait_full()
        self.chain.send_full(vector, self.steps)
        return vector

    def _step(self, known: Verdict, guess: bool) -> list[Rollback] | None:
        """Step every sub-optimizer as ``known`` says; with a guess, keep what undoing it needs."""
        if known.skip:
            return None
        rollbacks = None
        if guess:
            kind = ExactRollback if self.mode == "exact" else InPlaceRollback
            rollbacks = [kind(sub) for sub in self.subs if not getattr(sub, "is_stub_optimizer", False)]
        elif known.clip:
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            for sub in self.subs:
                parameters = sub.get_parameters()
                if not getattr(sub, "is_stub_optimizer", False) and parameters:
                    clip_grad_by_total_norm_fp32(parameters, max_norm=self.clip_grad, total_norm=known.grad_norm)
        for sub in self.subs:
            sub.step_with_ready_grads()
        return rollbacks

    def _update_scalers(self, known: Verdict) -> None:
        scaled = [sub for sub in self.subs if getattr(sub, "grad_scaler", None)]
        for sub, found in zip(scaled, known.found_inf, strict=True):
            sub.grad_scaler.update(found)

    # -- the check ----------------------------------------------------------------------------
    @torch.no_grad()
    def settle(self) -> bool:
        """Check the pending step against the full statistics; True when the work since must be redone.

        Called before the first backward of the next iteration (and before anything that reads
        the parameters: evaluation, checkpoints, the end of training). Every rank reaches the
        same answer, since every rank checks the same full vector.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        if not pending.complete:
            pending.vector = self.chain.wait_full()
        if not pending.relayed:
            self.chain.send_full(pending.vector, pending.step)
        known = verdict(pending.vector, self.layout, self.clip_grad)
        if not pending.complete:
            self._update_scalers(known)
        rolled_back = pending.rollbacks is not None and not known.plain
        if rolled_back:
            self._undo(pending, known)
        recompute = speculated(pending.vector) and not known.plain
        self.reports.append(StepReport(pending.step, known.skip, known.grad_norm, rolled_back, recompute))
        if rolled_back:
            log.info(
                "step %d %s after the full grad statistics arrived (norm %s)",
                pending.step,
                "skipped (inf/nan)" if known.skip else "redone with clipping",
                "n/a" if known.grad_norm is None else f"{known.grad_norm:.4g}",
            )
        return recompute

    def _undo(self, pending: _Pending, known: Verdict) -> None:
        for rollback in pending.rollbacks:
            rollback.undo()
            if known.clip:
                rollback.redo_clipped(known.grad_norm)
        if known.skip and pending.returned_success and self._scheduler is not None:
            increment = self._scheduler_increments.pop(pending.step, None)
            if increment:
                self._original_scheduler_step(-increment)  # as if the caller had not stepped it

    # -- the LR scheduler ---------------------------------------------------------------------
    _scheduler = None

    def attach_scheduler(self, scheduler) -> None:
        """Let a skipped step that was reported successful take back the scheduler's increment."""
        self._scheduler = scheduler
        self._scheduler_increments: dict[int, int] = {}
        self._original_scheduler_step = scheduler.step

        def step(increment: int) -> None:
            if self.pending is not None and not self.pending.complete:
                self._scheduler_increments[self.pending.step] = increment
            self._original_scheduler_step(increment)

        patching.replace(scheduler, "step", step, self.scope)

    def close(self) -> None:
        """Settle the last step and wait for the last messages (end of training)."""
        self.settle()
        self.chain.finish_sends()
        patching.undo(self.scope)


def _device(subs: list) -> torch.device:
    for sub in subs:
        for param in sub.get_parameters():
            return param.device
    return torch.device("cpu")
