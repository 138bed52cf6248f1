"""Undoing a speculative optimizer step: exactly from a snapshot, or in place by inverting Adam.

Both keep the step's gradients (main grads, unscaled, not clipped): a step that must be
redone with clipping needs them, and megatron-core zeroes the grad buffers at the start of
the next iteration. ``ExactRollback`` also copies what the step changes (main parameters and
the inner optimizer's state), so the undo is bit-exact. ``InPlaceRollback`` keeps no copy of
either: it runs the Adam update backwards, which costs a few ulps of rounding.
"""

from __future__ import annotations

import torch

SCHEDULED = ("lr", "weight_decay")  # what OptimizerParamScheduler sets on every param group


class Rollback:
    """What one sub-optimizer's speculative step needs to be undone and redone."""

    def __init__(self, sub):
        self.sub = sub
        self.params = [p for group in sub.optimizer.param_groups for p in group["params"]]
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.hyper = [{key: group[key] for key in SCHEDULED if key in group} for group in sub.optimizer.param_groups]

    def undo(self) -> None:
        raise NotImplementedError

    def redo_clipped(self, grad_norm: float) -> None:
        """Step again, as the synchronous path does: clip with the full norm, step with the step's own LR."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        sub, groups = self.sub, self.sub.optimizer.param_groups
        before = [p.grad for p in self.params]
        current = [{key: group[key] for key in SCHEDULED if key in group} for group in groups]
        for param, grad in zip(self.params, self.grads, strict=True):
            param.grad = grad
        if sub.config.clip_grad > 0.0 and self.params:
            clip_grad_by_total_norm_fp32(self.params, max_norm=sub.config.clip_grad, total_norm=grad_norm)
        for group, hyper in zip(groups, self.hyper, strict=True):
            group.update(hyper)
        try:
            sub.step_with_ready_grads()
        finally:
            for group, hyper in zip(groups, current, strict=True):
                group.update(hyper)
            for param, grad in zip(self.params, before, strict=True):
                param.grad = grad


class ExactRollback(Rollback):
    def __init__(self, sub):
        super().__init__(sub)
        self.values = [p.detach().clone() for p in self.params]
        state = sub.optimizer.state
        self.state = [_clone(state[p]) if p in state else None for p in self.params]
        self.group_steps = [group.get("step") for group in sub.optimizer.param_groups]  # FusedAdam keeps it here

    def undo(self) -> None:
        state = self.sub.optimizer.state
        with torch.no_grad():
            for param, value, saved in zip(self.params, self.values, self.state, strict=True):
                param.copy_(value)
                if saved is None:
                    state.pop(param, None)
                    continue
                for key, item in saved.items():
                    if torch.is_tensor(item) and torch.is_tensor(state[param].get(key)):
                        state[param][key].copy_(item)
                    else:
                        state[param][key] = _clone(item)
        for group, step in zip(self.sub.optimizer.param_groups, self.group_steps, strict=True):
            if step is not None:
                group["step"] = step
        publish(self.sub)


class InPlaceRollback(Rollback):
    """AdamW/Adam (torch, or FusedAdam with fp32 moments and no master weights), run backwards."""

    def __init__(self, sub):
        super().__init__(sub)
        check_invertible(sub)
        self.fresh = {id(p) for p in self.params if p not in sub.optimizer.state}  # no moments before this step

    def undo(self) -> None:
        optimizer = self.sub.optimizer
        with torch.no_grad():
            grads = {id(param): grad for param, grad in zip(self.params, self.grads, strict=True)}
            for group, hyper in zip(optimizer.param_groups, self.hyper, strict=True):
                group_step = group.get("step")
                for param in group["params"]:
                    grad = grads[id(param)]
                    if grad is not None:
                        _invert_adam(param, optimizer, grad, group, hyper, group_step)
                    if id(param) in self.fresh:  # the moments were zero: drop them rather than keep rounding
                        optimizer.state.pop(param, None)
                if isinstance(group_step, int):
                    group["step"] = group_step - 1
        publish(self.sub)


def _invert_adam(param, optimizer, grad: torch.Tensor, group: dict, hyper: dict, group_step) -> None:
    state = optimizer.state[param]
    beta1, beta2 = group["betas"]
    lr, weight_decay, eps = hyper.get("lr", group["lr"]), hyper.get("weight_decay", group["weight_decay"]), group["eps"]
    step_tensor = state.get("step")
    step = float(step_tensor) if step_tensor is not None else float(group_step)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=lr / (1 - beta1**step))  # the update, taken back
    decoupled = group.get("decoupled_weight_decay", getattr(optimizer, "adam_w_mode", True))
    if decoupled:
        param.div_(1 - lr * weight_decay)
        effective = grad
    else:
        effective = grad.add(param, alpha=weight_decay)
    # In float64, then rounded once: the moments lose the least to the subtraction.
    wide = effective.double()
    exp_avg.copy_((exp_avg.double() - (1 - beta1) * wide) / beta1)
    exp_avg_sq.copy_(((exp_avg_sq.double() - (1 - beta2) * wide * wide) / beta2).clamp_(min=0))
    if step_tensor is not None:
        step_tensor.sub_(1)


def check_invertible(sub) -> None:
    """Refuse optimizers whose update this module cannot run backwards."""
    optimizer = sub.optimizer
    name = type(optimizer).__name__
    if name not in ("Adam", "AdamW", "FusedAdam"):
        raise ValueError(
            f"in-place rollback inverts the Adam update; this optimizer is {name}: use the exact rollback "
            "(the default), which copies what the step changes"
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("in-place rollback does not invert Adam with amsgrad or maximize; use the exact rollback")
    if (
        getattr(optimizer, "master_weights", False)
        or getattr(optimizer, "exp_avg_dtype", torch.float32) != torch.float32
    ):
        raise ValueError(
            "in-place rollback needs fp32 Adam moments without FusedAdam master weights; use the exact rollback"
        )


def publish(sub) -> None:
    """Give the model the main parameters again (what step_with_ready_grads does after stepping)."""
    if hasattr(sub, "_copy_main_params_to_model_params") and not getattr(sub, "is_stub_optimizer", False):
        sub._copy_main_params_to_model_params()
    ddp_config = getattr(sub, "ddp_config", None)
    if ddp_config is not None and not ddp_config.overlap_param_gather:  # distributed optimizer: all-gather again
        for chunk in sub.model_chunks:
            chunk.start_param_sync()


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return value
