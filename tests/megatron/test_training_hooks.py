"""install() hooks Megatron-LM's training loop for post-validation; without the flag it changes nothing.

Megatron-LM is not installed here: a stand-in ``megatron.training.training`` holds the five
functions under Megatron-LM's names. The reductions record that they ran (a real one is an
all-reduce across pipeline stages), the optimizer factory returns a marker object.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from megatron_zb.megatron.training_hooks import HOOKED, hook_training_loop


@dataclass(frozen=True)
class Settings:
    post_validation: bool
    post_validation_rollback: str = "exact"
    p2p_timeout_s: float = 60.0


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch):
    module = types.ModuleType("megatron.training.training")
    module.calls = []

    def get_megatron_optimizer(config, model_chunks):
        module.calls.append("optimizer")
        return types.SimpleNamespace()

    def get_optimizer_param_scheduler(optimizer):
        module.calls.append("scheduler")
        return "scheduler"

    def logical_and_across_model_parallel_group(value):
        module.calls.append("all-reduce and")
        return value

    def reduce_max_stat_across_model_parallel_group(value):
        module.calls.append("all-reduce max")
        return value

    def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        module.calls.append("finalize")

    for function in (
        finalize_model_grads,
        get_megatron_optimizer,
        get_optimizer_param_scheduler,
        logical_and_across_model_parallel_group,
        reduce_max_stat_across_model_parallel_group,
    ):
        setattr(module, function.__name__, function)
    monkeypatch.setitem(sys.modules, "megatron.training.training", module)
    return module


def test_without_the_flag_every_call_reaches_megatron_lm(training) -> None:
    hook_training_loop(lambda: Settings(post_validation=False))
    assert all(getattr(training, name).megatron_zb_hook for name in HOOKED)
    training.get_optimizer_param_scheduler(training.get_megatron_optimizer("config", []))
    assert training.logical_and_across_model_parallel_group(True) is True
    assert training.reduce_max_stat_across_model_parallel_group(2.5) == 2.5
    training.finalize_model_grads([], None, force_all_reduce=True)  # chunks of megatron's placement: nothing else
    assert training.calls == ["optimizer", "scheduler", "all-reduce and", "all-reduce max", "finalize"]


def test_with_post_validation_the_step_statistics_stay_local(training) -> None:
    hook_training_loop(lambda: Settings(post_validation=True))
    assert training.logical_and_across_model_parallel_group(False) is False
    assert training.reduce_max_stat_across_model_parallel_group(None) is None
    assert training.calls == [], "a cross-stage all-reduce ran after the step"


def test_uninstall_puts_megatron_lms_functions_back(training) -> None:
    from megatron_zb import patching

    originals = {name: getattr(training, name) for name in HOOKED}
    hook_training_loop(lambda: None)
    assert all(getattr(training, name) is not originals[name] for name in HOOKED)
    patching.undo()
    assert all(getattr(training, name) is originals[name] for name in HOOKED)


def test_hooking_twice_wraps_once(training) -> None:
    hook_training_loop(lambda: None)
    first = training.get_megatron_optimizer
    hook_training_loop(lambda: None)
    assert training.get_megatron_optimizer is first
    assert first.__wrapped__.__name__ == "get_megatron_optimizer" and not hasattr(first.__wrapped__, "megatron_zb_hook")
