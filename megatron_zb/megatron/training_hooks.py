"""Post-validation inside Megatron-LM's own training loop (``megatron.training.training``).

Megatron-LM builds the optimizer and the LR scheduler itself, and after ``optimizer.step()``
its ``train_step`` reduces the step's success and grad norm over the model-parallel group:
two more all-reduces across pipeline stages at the end of every iteration, which would undo
what post-validation buys. With ``--enable-optimizer-post-validation`` these hooks wrap the
optimizer Megatron-LM builds, attach its scheduler (a skipped step takes its increment back),
and let each rank keep its own success flag and grad norm: the last pipeline stage, which logs,
has the validated values at once. Without the flag every hook calls Megatron-LM's function.

Written from Megatron-LM's train_step (core_r0.13 to core_r0.16) and not run against a real
checkout here; tests/megatron/test_training_hooks.py checks the wiring on a stand-in module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

HOOKED = (
    "get_megatron_optimizer",
    "get_optimizer_param_scheduler",
    "logical_and_across_model_parallel_group",
    "reduce_max_stat_across_model_parallel_group",
)


def hook_training_loop(settings: Callable) -> None:
    """Wrap them in a loaded ``megatron.training.training`` (idempotent); ``settings()`` is read per call."""
    training = sys.modules.get("megatron.training.training")
    if training is None:
        return
    for name in HOOKED:
        original = getattr(training, name, None)
        if original is None or getattr(original, "megatron_zb_hook", False):
            continue
        hooked = _HOOKS[name](original, settings)
        hooked.megatron_zb_hook = True
        hooked.__wrapped__ = original
        setattr(training, name, hooked)


def _validating(settings: Callable) -> bool:
    found = settings()
    return found is not None and found.post_validation


def _optimizer(original, settings):
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = original(config, model_chunks, *args, **kwargs)
        found = settings()
        if found is not None and found.post_validation:
            from megatron.core import parallel_state

            from ..optimizer import PostValidation

            PostValidation(
                optimizer,
                list(model_chunks),
                parallel_state.get_pipeline_model_parallel_group(),
                mode=found.post_validation_rollback,
                timeout_s=found.p2p_timeout_s,
            )
        return optimizer

    return get_megatron_optimizer


def _scheduler(original, settings):
    def get_optimizer_param_scheduler(optimizer, *args, **kwargs):
        scheduler = original(optimizer, *args, **kwargs)
        validation = getattr(optimizer, "post_validation", None)
        if validation is not None:
            validation.attach_scheduler(scheduler)
        return scheduler

    return get_optimizer_param_scheduler


def _local_flag(original, settings):
    def logical_and_across_model_parallel_group(value, *args, **kwargs):
        return bool(value) if _validating(settings) else original(value, *args, **kwargs)

    return logical_and_across_model_parallel_group


def _local_stat(original, settings):
    def reduce_max_stat_across_model_parallel_group(value, *args, **kwargs):
        return value if _validating(settings) else original(value, *args, **kwargs)

    return reduce_max_stat_across_model_parallel_group


_HOOKS = {
    "get_megatron_optimizer": _optimizer,
    "get_optimizer_param_scheduler": _scheduler,
    "logical_and_across_model_parallel_group": _local_flag,
    "reduce_max_stat_across_model_parallel_group": _local_stat,
}
