"""megatron_zb.compat: the supported megatron-core range, refused at import, and the feature checks."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_zb import compat

ROOT = Path(__file__).resolve().parents[1]
RANGE_MESSAGE = (
    "megatron-zb supports megatron-core >=0.16.1,<0.20 (and Megatron-LM checkouts from core_v0.16.1 to main)"
)


@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.18.2", "0.19.2", "0.19.3rc0"])
def test_supported_releases_pass(version: str) -> None:
    compat.check_version(version)


@pytest.mark.parametrize("version", ["0.16.0", "0.15.3", "0.20.0", "0.20.0rc1", "1.0.0"])
def test_unsupported_releases_are_refused_naming_the_range(version: str, monkeypatch) -> None:
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(compat.UnsupportedMegatronCoreError) as refused:
        compat.check_version(version)
    assert str(refused.value) == (
        f"{RANGE_MESSAGE}; found megatron-core {version}. Install a supported one, e.g. pip install "
        "'megatron-core>=0.16.1,<0.20' (0.17 and later need Python 3.12), or set "
        "MZB_ALLOW_UNSUPPORTED_MEGATRON_CORE=1 to try this one anyway"
    )


def test_megatron_lm_main_checkout_passes_but_not_the_next_line(monkeypatch) -> None:
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    compat.check_version("0.20.0", checkout=True)  # main of 2026-08 says 0.20.0
    with pytest.raises(
        compat.UnsupportedMegatronCoreError, match="found a Megatron-LM checkout of megatron-core 0.21.0"
    ):
        compat.check_version("0.21.0", checkout=True)
    with pytest.raises(compat.UnsupportedMegatronCoreError, match="checkout of megatron-core 0.15.0"):
        compat.check_version("0.15.0", checkout=True)


def test_missing_megatron_core_is_named() -> None:
    with pytest.raises(compat.UnsupportedMegatronCoreError, match=r"needs megatron-core >=0.16.1,<0.20, and none"):
        compat.check_version(None)


def test_the_override_turns_the_refusal_into_a_warning(monkeypatch) -> None:
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="found megatron-core 0.20.0"):
        compat.check_version("0.20.0")


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("0.16.1", (0, 16, 1)), ("0.20.0rc0", (0, 20, 0)), ("0.20.0+d98e8a6", (0, 20, 0)), ("0.19.2.dev1", (0, 19, 2))],
)
def test_version_tuple(text: str, numbers: tuple) -> None:
    assert compat.version_tuple(text) == numbers


def test_package_info_is_read_without_running_it(tmp_path: Path) -> None:
    """Megatron-LM main's package_info.py runs git; the check parses the file instead."""
    info = tmp_path / "package_info.py"
    info.write_text('MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = "rc1"\nraise SystemExit("executed")\n')
    assert compat.read_version(info) == "0.20.0rc1"
    info.write_text("VERSION = (0, 1)\n")
    assert compat.read_version(info) is None


def test_setup_py_declares_the_checked_range() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    declared = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEGATRON_CORE" for t in node.targets)
    ]
    assert declared == [f"megatron-core{compat.SUPPORTED_RANGE}"]


def test_the_loaded_megatron_core_is_supported() -> None:
    """Whatever this suite runs on (0.16.1, 0.19.2, a 0.17.1 on PYTHONPATH) passes the check, as a release."""
    info = compat.megatron_core_package_info()
    assert info is not None and compat.read_version(info) is not None
    compat.require_supported_megatron_core()


FAKE_IMPORT = """
import json, sys
found = {}
from megatron_zb.schedule import ScheduleSpec, build  # the pure-Python core does not care
found["schedule"] = build("1f1b", ScheduleSpec(pp=2, microbatches=4)).name
try:
    import megatron_zb.runtime
    found["runtime"] = "imported"
except ImportError as error:
    found["runtime"] = [type(error).__name__, str(error)]
import megatron_zb
try:
    megatron_zb.install()
    found["install"] = "installed"
except ImportError as error:
    found["install"] = [type(error).__name__, str(error)]
found["megatron.core imported"] = "megatron.core" in sys.modules
print(json.dumps(found))
"""


def test_runtime_and_install_refuse_an_unsupported_megatron_core(tmp_path: Path) -> None:
    """A fake pip-installed megatron-core 0.20.0 first on the path: both entry points refuse it, by name."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('the fake megatron-core was imported')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\n")
    dist = tmp_path / "megatron_core-0.20.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop(compat.ALLOW_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAKE_IMPORT)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    refusal = ["UnsupportedMegatronCoreError", f"{RANGE_MESSAGE}; found megatron-core 0.20.0. " + _REST]
    assert found == {"schedule": "1f1b", "runtime": refusal, "install": refusal, "megatron.core imported": False}


def test_a_megatron_core_no_distribution_owns_is_a_checkout(tmp_path: Path) -> None:
    info = tmp_path / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\n")
    assert not compat._is_pip_installed(info)
    assert compat._is_pip_installed(compat.megatron_core_package_info())  # this suite's megatron-core is a wheel


_REST = (
    "Install a supported one, e.g. pip install 'megatron-core>=0.16.1,<0.20' (0.17 and later need Python 3.12), "
    "or set MZB_ALLOW_UNSUPPORTED_MEGATRON_CORE=1 to try this one anyway"
)


# -- feature checks on the loaded megatron-core -------------------------------------------------


def test_feature_checks_agree_with_the_loaded_megatron_core() -> None:
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    linear = inspect.signature(layers.linear_with_grad_accumulation_and_async_allreduce).parameters
    takes_pg_collection = compat.accepts(schedules.get_forward_backward_func, "schedule_pg_collection")
    # 0.19 brought all of these together; 0.17 dropped async_grad_allreduce and encoder_and_decoder.
    assert takes_pg_collection == ("gtp_remat_size" in linear)
    assert takes_pg_collection == compat.optimizer_checks_grad_norm_groups()
    assert takes_pg_collection == hasattr(MegatronOptimizer, "get_grads_for_grad_norm")
    assert compat.encoder_and_decoder_model_type() is None  # 0.16: a property, 0.17+: gone
    if "async_grad_allreduce" not in linear:
        assert compat.version_tuple(compat.read_version(compat.megatron_core_package_info())) >= (0, 17)


def test_split_linear_binds_arguments_by_the_loaded_signature(monkeypatch) -> None:
    """Old (async_grad_allreduce) and new (gtp_remat_size) signatures, positional or keyword, outside and inside."""
    import torch

    from megatron_zb.runtime import linear_split
    from megatron_zb.runtime.wgrad import WeightGradStore

    calls = []

    def v016(input, weight, bias, fusion, allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
             wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None):  # fmt: skip
        calls.append(("0.16", async_grad_allreduce, tp_group))
        return torch.nn.functional.linear(input, weight, bias)

    def v019(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
             grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1):  # fmt: skip
        calls.append(("0.19", gtp_remat_size, tp_group))
        return torch.nn.functional.linear(input, weight, bias)

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    expected = torch.nn.functional.linear(x, w)
    group = object()  # not used: no sequence parallelism, no dgrad all-reduce
    for original in (v016, v019):
        monkeypatch.setattr(linear_split, "_original", original)
        monkeypatch.setattr(linear_split, "_bind", compat.argument_binder(original))
        # Outside our passes: megatron-core's function gets exactly what it was called with.
        assert torch.equal(linear_split.splittable_linear(x, w, None, False, False, False, tp_group=group), expected)
    assert calls == [("0.16", None, group), ("0.19", 1, group)]
    store = WeightGradStore()
    with store.recording():
        out = linear_split.splittable_linear(x, w, None, False, False, False, None, 0, group, gtp_remat_size=1)
        torch.testing.assert_close(out, expected)
        with pytest.raises(NotImplementedError, match=r"GTP-sharded weights \(gtp_remat_size=2\)"):
            linear_split.splittable_linear(x, w, None, False, False, False, tp_group=group, gtp_remat_size=2)
        with pytest.raises(TypeError, match="async_grad_allreduce"):  # 0.19 has no such argument
            linear_split.splittable_linear(x, w, None, False, False, False, async_grad_allreduce=True)
    assert len(calls) == 2  # inside, the split linear ran, not megatron-core's
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(3, 5).t() @ x)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1, 2, 3), {"gradient_accumulation_fusion": False, "allreduce_dgrad": True, "sequence_parallel": False}),
        ((1, 2, 3, False, True, False, None, 2), {}),
        ((1, 2), {"bias": 3, "gradient_accumulation_fusion": 0, "allreduce_dgrad": 0, "sequence_parallel": 0}),
        ((1, 2, 3), {"bogus": 1}),  # unknown name
        ((1, 2, 3), {"input": 1}),  # given twice
        ((1,), {}),  # missing ones
        (tuple(range(11)), {}),  # too many
    ],
)
def test_argument_binder_answers_as_signature_bind(args, kwargs):
    """The linear's arguments by name on every call: what ``bind`` gives, and ``bind``'s TypeError where it raises."""
    import inspect

    from megatron.core.tensor_parallel import layers

    from megatron_zb.compat import argument_binder

    function = layers.linear_with_grad_accumulation_and_async_allreduce

    def outcome(bind) -> object:
        try:
            return bind()
        except TypeError as error:
            return ("TypeError", str(error))

    def reference() -> dict:
        bound = inspect.signature(function).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    assert outcome(lambda: argument_binder(function)(args, kwargs)) == outcome(reference)
