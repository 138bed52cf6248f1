"""``megatron_zb.install()`` reaches every bound copy of get_forward_backward_func, in either import order.

Megatron-LM is not installed here; its ``megatron.training.training`` binds the function with
``from megatron.core.pipeline_parallel import get_forward_backward_func``, which the scripts
reproduce in a module of that name. Each order runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

TRAINING_BEFORE = """
import sys, types
training = types.ModuleType("megatron.training.training")
exec("from megatron.core.pipeline_parallel import get_forward_backward_func", training.__dict__)
sys.modules["megatron.training.training"] = training
import megatron_zb
megatron_zb.install()
"""

TRAINING_AFTER = """
import sys, types
import megatron_zb
megatron_zb.install()
training = types.ModuleType("megatron.training.training")
exec("from megatron.core.pipeline_parallel import get_forward_backward_func", training.__dict__)
sys.modules["megatron.training.training"] = training
"""

CHECKS = """
import argparse, json
import megatron.core.pipeline_parallel as package
import megatron.core.pipeline_parallel.schedules as schedules
from megatron_zb.megatron import install
from megatron_zb.runtime import ForwardBackward

bound = [package.get_forward_backward_func, schedules.get_forward_backward_func,
         sys.modules["megatron.training.training"].get_forward_backward_func]
found = {"all_ours": all(f is install.get_forward_backward_func for f in bound)}
get = sys.modules["megatron.training.training"].get_forward_backward_func
# Disabled: megatron-core's own choice, extra arguments of newer versions passed through.
found["disabled_pp1"] = get(pp_size=1, vp_size=None).__name__
found["disabled_pp4"] = get(pp_size=4, vp_size=None).__name__
found["disabled_pp4_vp2"] = get(pp_size=4, vp_size=2).__name__
try:
    get(pp_size=1, schedule_pg_collection=None)
    found["extra_kwarg"] = "accepted"
except TypeError as error:
    found["extra_kwarg"] = "passed to megatron-core: " + str(error)
from megatron_zb import compat
found["takes_schedule_pg_collection"] = compat.accepts(
    install.megatron_core_forward_backward_func(), "schedule_pg_collection"
)
# Enabled through Megatron-LM's parsed arguments (what the patched pretrain_gpt.py gives).
global_vars = types.ModuleType("megatron.training.global_vars")
args = megatron_zb.add_args(argparse.ArgumentParser()).parse_args(["--zero-bubble-v-schedule"])
args.pipeline_model_parallel_size, args.num_layers = 4, 16
args.micro_batch_size, args.global_batch_size, args.data_parallel_size = 1, 8, 1
global_vars._GLOBAL_ARGS = args
sys.modules["megatron.training.global_vars"] = global_vars
runner = get(pp_size=4, vp_size=None)
found["enabled"] = [type(runner).__name__, runner.name, runner.losses_to_last_rank]
found["same_runner"] = get() is runner
found["replan_window"] = [runner.replanner.window.start, runner.replanner.window.end]
args.no_zero_bubble_replan = True
global_vars._GLOBAL_ARGS = argparse.Namespace(**vars(args))
found["replan_off"] = get().replanner is None
# configure() overrides the parsed arguments; None turns zero bubble off.
install.configure(None)
found["configured_off"] = get(pp_size=4).__name__
megatron_zb.uninstall()
found["uninstalled"] = package.get_forward_backward_func is install.megatron_core_forward_backward_func()
print(json.dumps(found))
"""


@pytest.mark.parametrize("order", [TRAINING_BEFORE, TRAINING_AFTER], ids=["training-imported-first", "install-first"])
def test_every_bound_copy_is_ours_whatever_the_import_order(order: str) -> None:
    script = textwrap.dedent(order) + textwrap.dedent(CHECKS)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "all_ours": True,
        "disabled_pp1": "forward_backward_no_pipelining",
        "disabled_pp4": "forward_backward_pipelining_without_interleaving",
        "disabled_pp4_vp2": "forward_backward_pipelining_with_interleaving",
        "extra_kwarg": found["extra_kwarg"],
        "takes_schedule_pg_collection": found["takes_schedule_pg_collection"],
        "enabled": ["ForwardBackward", "zb-v", True],
        "same_runner": True,
        "replan_window": [100, 110],
        "replan_off": True,
        "configured_off": "forward_backward_pipelining_without_interleaving",
        "uninstalled": True,
    }
    # 0.19 takes schedule_pg_collection; 0.16 has none: the argument reaches it either way, we do not drop it.
    if found["takes_schedule_pg_collection"]:
        assert found["extra_kwarg"] == "accepted"
    else:
        assert found["extra_kwarg"].startswith("passed to megatron-core")
        assert "schedule_pg_collection" in found["extra_kwarg"]


def test_importing_megatron_zb_needs_no_torch() -> None:
    """The CLI and the schedule core run without torch; the package root must not import it."""
    script = "import sys, megatron_zb; print('torch' in sys.modules, 'megatron.core' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_only_the_latest_settings_keep_a_runner_and_uninstall_drops_it() -> None:
    """A runner holds its latest model and process groups: settings of an earlier run must not keep one alive."""
    import dataclasses

    from megatron_zb.megatron import install
    from megatron_zb.megatron.args import ZeroBubbleSettings
    from megatron_zb.schedule.placement import Placement

    linear = Placement(kind="linear", pp=2, chunks=1, blocks=((0, 0), (1, 0)))
    first = ZeroBubbleSettings("zb-1p", None, None, 4, (linear,), False, None, None, False, "exact", 60.0)
    second = dataclasses.replace(first, schedule="zb-2p")
    try:
        runner = install.runner_for(first)
        assert install.runner_for(first) is runner  # kept across iterations
        assert install.runner_for(second) is not runner
        assert list(install._runners) == [second]
        install.uninstall()
        assert install._runners == {}
    finally:
        install.uninstall()
