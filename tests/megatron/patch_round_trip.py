"""Run by test_patch_round_trip.py in a fresh interpreter: every change megatron-zb makes to torch,
megatron-core and Megatron-LM, made and undone, must leave them exactly as found.

``snapshot()`` copies the namespace of every loaded ``megatron`` module, of the torch modules the
shims touch (``torch``, ``torch.cuda``, ``torch.cpu``, ``torch.distributed``, ``distributed_c10d``),
of every class those megatron modules define and of ``torch.Tensor``, and the thread's torch
function-mode stack. ``differences()`` names every attribute whose object is not the one found
(an attribute that was inherited and is now set on the class counts too). The script enables and
installs everything (``megatron_zb.cpu`` or ``megatron_lm.cpu``, ``install()``, the B/W linear
split, Megatron-LM's launcher hooks where ``megatron.training`` exists, the watchdog's and the
recorder's collective wrappers stopped in and out of order), undoes it twice over, and prints one
JSON line: what differs, which registry entries were in force, and any replacement still held.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
import tempfile
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402
from torch.overrides import _get_current_function_mode_stack  # noqa: E402

TORCH_MODULES = ("torch", "torch.cuda", "torch.cpu", "torch.distributed", "torch.distributed.distributed_c10d")
# What the phases below touch, imported first as a program using megatron-core would have.
MEGATRON_CORE = (
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.parallel_state",
    "megatron.core.datasets.utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
)
MEGATRON_LM = (
    "megatron.training",
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.arguments",
    "megatron.training.utils",
)
MISSING = object()
PLAIN = (str, bytes, int, float, complex)  # equal is the same here: such values are not always one object


def has_megatron_lm() -> bool:
    return importlib.util.find_spec("megatron.training") is not None


def watched_modules() -> list[str]:
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if module is not None and (name == "megatron" or name.startswith("megatron.") or name in TORCH_MODULES)
    )


def watched_classes(modules: list[str]) -> dict[str, type]:
    classes = {"torch.Tensor": torch.Tensor}
    for name in modules:
        if not name.startswith("megatron"):
            continue
        for value in list(vars(sys.modules[name]).values()):
            if inspect.isclass(value) and getattr(value, "__module__", "").startswith("megatron"):
                classes.setdefault(f"{value.__module__}.{value.__qualname__}", value)
    return classes


def snapshot() -> dict:
    modules = watched_modules()
    return {
        "modules": {name: dict(vars(sys.modules[name])) for name in modules},
        "classes": {name: (cls, dict(vars(cls))) for name, cls in watched_classes(modules).items()},
        "modes": list(_get_current_function_mode_stack()),
    }


def _same(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, PLAIN) and a == b)


def _describe(value: object) -> str:
    if value is MISSING:
        return "(not set)"
    return f"{getattr(value, '__module__', type(value).__module__)}.{getattr(value, '__qualname__', repr(value))}"


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for name, namespace in before["modules"].items():
        now = after["modules"].get(name, {})
        for attribute in sorted(set(namespace) | set(now)):
            old, new = namespace.get(attribute, MISSING), now.get(attribute, MISSING)
            if old is MISSING and inspect.ismodule(new):
                continue  # a submodule imported since: an import, not a patch
            if not _same(old, new):
                found.append(f"{name}.{attribute}: {_describe(old)} -> {_describe(new)}")
    for name, (cls, namespace) in before["classes"].items():
        now = dict(vars(cls))
        for attribute in sorted(set(namespace) | set(now)):
            old, new = namespace.get(attribute, MISSING), now.get(attribute, MISSING)
            if not _same(old, new):
                found.append(f"{name}.{attribute}: {_describe(old)} -> {_describe(new)}")
    modes, now = before["modes"], after["modes"]
    if len(modes) != len(now) or any(a is not b for a, b in zip(modes, now, strict=True)):
        found.append(f"torch function-mode stack: {before['modes']} -> {after['modes']}")
    return found


def held_anywhere(replacements: list[object], before: dict) -> list[str]:
    """Attributes of modules loaded since ``before`` (outside megatron_zb) that still hold one of ``replacements``.

    The modules ``before`` saw are compared attribute by attribute in ``differences``.
    """
    ids = {id(r): r for r in replacements if r is not None}  # None: every unset attribute (compared in differences)
    held = []
    for name, module in list(sys.modules.items()):
        if module is None or name in before["modules"] or name.split(".")[0] in ("megatron_zb", __name__):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in ids and ids[id(value)] is value:
                held.append(f"{name}.{attribute} holds {_describe(value)}")
    return held


def _import_all() -> None:
    for name in MEGATRON_CORE + (MEGATRON_LM if has_megatron_lm() else ()):
        importlib.import_module(name)
    for name in (
        "megatron_zb.cpu",
        "megatron_zb.megatron.install",
        "megatron_zb.runtime.linear_split",
        "megatron_zb.runtime.expert_comm",
        "megatron_zb.training.collectives",
        "megatron_zb.training.watchdog",
    ):
        importlib.import_module(name)
    if has_megatron_lm():
        for name in ("launch", "pretrain", "validation", "cpu"):
            importlib.import_module(f"megatron_zb.megatron_lm.{name}")


def _collectives() -> list[list[str]]:
    """The watchdog's wrappers and a recorder stacked on them, stopped out of order and then in order."""
    from megatron_zb import patching
    from megatron_zb.training.collectives import CollectiveRecorder
    from megatron_zb.training.watchdog import CollectiveWatch, P2PWatch

    watch, transfers, recorder = CollectiveWatch(60.0, {}), P2PWatch(60.0), CollectiveRecorder()
    active = []
    for order in ((watch, recorder, transfers), (transfers, recorder, watch)):
        watch.start()
        transfers.start()
        recorder.start()
        active.append(sorted({scope.split("#")[0] for scope in patching.scopes()} - set(_NAMED)))
        for wrapper in order:
            wrapper.stop()
    return active


def enable_everything(metrics_file: str) -> tuple[list, list]:
    """Every patch megatron-zb makes in this venv: (the registry's entries in force, the collective scopes)."""
    import megatron_zb
    from megatron_zb import patching
    from megatron_zb.runtime import expert_comm, linear_split

    if has_megatron_lm():
        from megatron.training import training

        from megatron_zb.megatron_lm import cpu as megatron_lm_cpu
        from megatron_zb.megatron_lm import pretrain, validation

        megatron_lm_cpu.enable()
    else:
        from megatron_zb import cpu

        cpu.enable()
    megatron_zb.install()
    linear_split.install()
    expert_comm.install()
    if has_megatron_lm():
        validation.check_flags_before_init()
        pretrain._write_metrics(training, metrics_file)
    collectives = _collectives()
    return patching.applied(), collectives


def undo_everything() -> None:
    import megatron_zb

    megatron_zb.uninstall()
    if has_megatron_lm():
        from megatron_zb.megatron_lm import cpu as megatron_lm_cpu

        megatron_lm_cpu.disable()  # megatron-lm-cpu and megatron_zb.cpu's shims
    else:
        from megatron_zb import cpu

        cpu.disable()
    from megatron_zb import patching

    patching.undo(patching.MEGATRON_LM)


def main() -> None:
    from megatron_zb import patching

    _import_all()
    before = snapshot()
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(2):  # a second round: enable() after disable() patches again, and undoes again
            in_force, collectives = enable_everything(f"{folder}/metrics.jsonl")
            modes = [type(mode).__name__ for mode in _get_current_function_mode_stack()]
            undo_everything()
            rounds.append(
                {
                    "in_force": sorted({_entry(patch) for patch in in_force}),
                    "collective_scopes": collectives,
                    "modes_while_enabled": modes,
                    "differences": differences(before, snapshot()),
                    "held": held_anywhere([p.replacement for p in in_force if p.kind == "attribute"], before),
                    "left_in_registry": [_entry(patch) for patch in patching.applied()],
                }
            )
    print(json.dumps({"megatron_lm": has_megatron_lm(), "rounds": rounds}))


_NAMED = ("megatron", "cpu", "megatron-lm-cpu", "megatron-lm")


def _entry(patch) -> str:
    if patch.kind == "mode":
        return f"{patch.scope}: torch function mode {patch.name}"
    owner = patch.owner
    name = getattr(owner, "__name__", None) if inspect.ismodule(owner) else getattr(owner, "__qualname__", None)
    return f"{patch.scope}: {name or type(owner).__name__}.{patch.name}"


if __name__ == "__main__":
    main()
