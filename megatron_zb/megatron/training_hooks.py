"""Hooks inside Megatron-LM's own training loop (``megatron.training.training``).

Post-validation: Megatron-LM builds the optimizer and the LR scheduler itself, and after
``optimizer.step()`` its ``train_step`` reduces the step's success and grad norm over the
model-parallel group: two more all-reduces across pipeline stages at the end of every
iteration, which would undo what post-validation buys. With ``--enable-optimizer-post-validation``
these hooks wrap the optimizer Megatron-LM builds, attach its scheduler (a skipped step takes its
increment back), and let each rank keep its own success flag and grad norm: the last pipeline
stage, which logs, has the validated values at once.

Placements megatron does not build itself (V): before the optimizer is built the model chunks
are finished for the placement (``placement_hooks.prepare_chunks``), and Megatron-LM's
``finalize_model_grads`` also sums the tied-embedding copies one rank holds. Without these
settings every hook calls Megatron-LM's function. Each replacement is recorded in ``patching``.
tests/megatron/test_training_hooks.py checks the wiring on a stand-in module,
tests/megatron/test_real_megatron_lm.py on real checkouts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .. import patching

HOOKED = (
    "get_megatron_optimizer",
    "get_optimizer_param_scheduler",
    "logical_and_across_model_parallel_group",
    "reduce_max_stat_across_model_parallel_group",
    "finalize_model_grads",
)


def hook_training_loop(settings: Callable) -> None:
    """Wrap them in a loaded ``megatron.training.training`` (idempotent); ``settings()`` is read per call."""
    training = sys.modules.get("megatron.training.training")
    if training is None:
        return
    for name in HOOKED:
        patching.hook(training, name, lambda original, name=name: _HOOKS[name](original, settings))


def _validating(settings: Callable) -> bool:
    found = settings()
    return found is not None and found.post_validation


def _optimizer(original, settings):
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        from .placement_hooks import prepare_chunks

        prepare_chunks(list(model_chunks))
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
                scope=patching.MEGATRON_LM,  # undone when Megatron-LM's pretrain() returns
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


def _finalize(original, settings):
    from .placement_hooks import tied_finalize

    return tied_finalize(original)


_HOOKS = {
    "get_megatron_optimizer": _optimizer,
    "get_optimizer_param_scheduler": _scheduler,
    "logical_and_across_model_parallel_group": _local_flag,
    "reduce_max_stat_across_model_parallel_group": _local_stat,
    "finalize_model_grads": _finalize,
}
