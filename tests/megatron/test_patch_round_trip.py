"""Every change megatron-zb makes to torch, megatron-core and Megatron-LM goes through one registry
(``megatron_zb.patching``), and undoing it leaves them exactly as found.

The round trip runs in a fresh interpreter (``patch_round_trip.py``): it enables and installs
everything this venv supports, undoes it, twice, and compares the namespaces of every loaded
megatron module, of the torch modules the CPU shims touch, of every class those megatron modules
define and of ``torch.Tensor``, and torch's function-mode stack, object for object. The other tests
here check the registry's rules on objects of their own, in this process.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from megatron_zb import patching

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "patch_round_trip.py"

# Entries that must be in force once everything is enabled: one or more per site the issue names (an entry
# another is stacked on, as megatron-lm-cpu's torch.cuda.current_stream on cpu's, is not in force).
SITES = [
    "cpu: torch.cuda.current_device",
    "cpu: torch.cuda.empty_cache",
    "cpu: Tensor.type",
    "cpu: torch function mode _CudaToCpu",
    "cpu: megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
    "cpu: MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
    "cpu: megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
    "megatron: megatron.core.pipeline_parallel.get_forward_backward_func",
    "megatron: megatron.core.pipeline_parallel.schedules.get_forward_backward_func",
    "megatron: megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce",
    "megatron: GPTModel.__init__",
    "megatron: WrappedTorchNorm.__new__",
]
MEGATRON_LM_SITES = [
    "megatron-lm-cpu: torch.cuda.device_count",
    "megatron-lm-cpu: torch.cuda.current_stream",
    "megatron-lm-cpu: megatron.core.tensor_parallel.model_parallel_cuda_manual_seed",
    "megatron-lm-cpu: megatron.core.datasets.utils.compile_helpers",
    "megatron-lm-cpu: megatron.training.initialize.initialize_megatron",
    "megatron-lm-cpu: megatron.training.training.initialize_megatron",
    "megatron-lm-cpu: megatron.training.utils.get_device_arch_version",
    "megatron-lm-cpu: megatron.training.arguments.get_device_arch_version",
    "megatron: megatron.training.arguments.validate_args",  # 0.19's initialize parses before calling it
    "megatron: megatron.training.training.get_megatron_optimizer",
    "megatron: megatron.training.utils.is_first_or_last_pipeline_stage",
    "megatron-lm: megatron.training.training.training_log",
]


def test_enable_install_and_undo_leave_torch_megatron_core_and_megatron_lm_as_found() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    expected = SITES + (MEGATRON_LM_SITES if found["megatron_lm"] else [])
    for number, round_ in enumerate(found["rounds"], 1):
        assert round_["differences"] == [], f"round {number}: not as found after undo"
        assert round_["held"] == [], f"round {number}: a replacement is still bound"
        assert round_["left_in_registry"] == [], f"round {number}: entries still in force"
        assert [site for site in expected if site not in round_["in_force"]] == [], f"round {number}: not recorded"
        assert "_CudaToCpu" in round_["modes_while_enabled"]
        # the watchdog's two wrappers and the recorder, each in its own scope while active
        assert round_["collective_scopes"] == [["collectives:CollectiveRecorder", "collectives:CollectiveWatch",
                                                "collectives:P2PWatch"]] * 2  # fmt: skip


# -- the registry's rules, on objects of these tests' own ----------------------------------------
SCOPE = "test-patching"


@pytest.fixture
def owner():
    module = types.ModuleType("megatron_zb_test_owner")
    module.value = original
    yield module
    patching.undo(SCOPE)


def original():
    return "original"


def test_stacked_replacements_undone_out_of_order_restore_the_original(owner) -> None:
    inner = patching.replace(owner, "value", lambda: "inner", SCOPE)
    outer = patching.replace(owner, "value", lambda: "outer", "test-patching-outer")
    patching.undo(SCOPE)  # the inner first: the outer stays, and now restores what the inner found
    assert owner.value is outer.replacement and not patching.in_force(inner)
    patching.undo("test-patching-outer")
    assert owner.value is original and patching.applied(SCOPE) == patching.applied("test-patching-outer") == []


def test_an_inherited_attribute_is_deleted_again() -> None:
    class Base:
        def name(self):
            return "base"

    class Child(Base):
        pass

    patching.replace(Child, "name", lambda self: "ours", SCOPE)
    assert Child().name() == "ours"
    patching.undo(SCOPE)
    assert "name" not in vars(Child) and Child().name() == "base"


def test_a_remembered_state_comes_back_whatever_it_became(owner) -> None:
    owner.state = "found"
    patching.remember(owner, "state", SCOPE)
    owner.state = "changed twice"
    patching.undo(SCOPE)
    assert owner.state == "found"


def test_a_late_importer_of_an_everywhere_replacement_gets_the_original(owner) -> None:
    sys.modules[owner.__name__] = owner
    late = types.ModuleType("megatron_zb_test_late")
    try:
        assert patching.replace_everywhere(original, lambda: "ours", "value", SCOPE) == 1
        late.value = owner.value  # imported while installed: took ours by name
        sys.modules[late.__name__] = late
        patching.undo(SCOPE)
        assert owner.value is original and late.value is original
    finally:
        sys.modules.pop(owner.__name__, None)
        sys.modules.pop(late.__name__, None)


def test_a_function_mode_leaves_the_stack_from_wherever_it_sits() -> None:
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    before = _get_current_function_mode_stack()
    ours = Passing()
    patching.enter_mode(ours, SCOPE)
    with Passing() as above:
        patching.undo(SCOPE)  # below a mode entered later: that one stays
        assert _get_current_function_mode_stack() == [*before, above]
        assert torch.ones(1).sum().item() == 1.0
    assert _get_current_function_mode_stack() == before


def test_a_function_mode_is_undone_on_its_own_thread_only() -> None:
    pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    patching.enter_mode(Passing(), SCOPE)
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, lambda: patching.undo(SCOPE)))
    thread.start()
    thread.join()
    assert "entered on another thread" in str(errors[0])
    patching.undo(SCOPE)
    assert patching.applied(SCOPE) == []


def _catch(errors: list, call) -> None:
    try:
        call()
    except RuntimeError as error:
        errors.append(error)


# -- what the Megatron flags read, and from where ----------------------------------------------
def test_megatron_args_imports_nothing_from_training() -> None:
    """megatron/args.py sits below training/: the checks both use live in megatron_zb/checks.py."""
    tree = ast.parse((ROOT / "megatron_zb" / "megatron" / "args.py").read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [module for module in imported if "training" in module.split(".")] == []


def test_settings_carry_placements_only() -> None:
    from megatron_zb.megatron.args import ZeroBubbleSettings
    from megatron_zb.schedule.placement import linear

    assert "placement" not in {field.name for field in dataclasses.fields(ZeroBubbleSettings)}
    settings = ZeroBubbleSettings("zb-1p", None, None, 4, (linear(2),), False, None, None, False, "exact", 60.0)
    assert settings.placement is settings.placements[0]


def test_which_schedules_take_a_memory_limit_is_the_registrys_to_say() -> None:
    import argparse

    from megatron_zb.megatron.args import add_args, schedule_settings
    from megatron_zb.schedule.registry import get, names, with_option

    assert with_option("memory_limit") == [name for name in names() if "memory_limit" in get(name).options]
    assert {"zb-auto", "v-auto", "auto", "bitpipe-zb"} <= set(with_option("memory_limit"))
    args = add_args(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", "zb-h1"])
    args.zero_bubble_memory_limit = 6.0
    args.pipeline_model_parallel_size, args.num_layers, args.micro_batch_size, args.global_batch_size = 4, 8, 1, 8
    with pytest.raises(ValueError, match=rf"\({', '.join(with_option('memory_limit'))}\), not to zb-h1"):
        schedule_settings(args)
