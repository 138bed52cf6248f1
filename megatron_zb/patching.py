"""The one record of every change megatron-zb makes to torch, megatron-core and Megatron-LM, by scope.

Megatron-LM binds many functions by name at import time (``from megatron.training.utils import
is_first_or_last_pipeline_stage`` in pretrain_gpt.py, ...), so a hook has to replace every loaded
copy, and the source attribute so later importers bind it too. Each replacement is recorded here
with what it replaced, under the scope that made it, and ``undo(scope)`` puts the originals back:

- ``megatron``: ``megatron_zb.install()`` (``get_forward_backward_func`` everywhere, the placement,
  training-loop and norm hooks), ``check_flags_before_init()`` and the runtime's B/W linear split;
  ``megatron_zb.uninstall()``.
- ``cpu``: ``megatron_zb.cpu.enable()``: ``torch.cuda`` functions, ``Tensor.type``, the function mode
  that maps CUDA devices to the CPU, megatron-core's RNG tracker; ``cpu.disable()``.
- ``megatron-lm-cpu``: ``megatron_lm.cpu.enable()``: more of ``torch.cuda`` and Megatron-LM's start-up;
  ``megatron_lm.cpu.disable()``.
- ``megatron-lm``: what the ``--megatron-lm`` launcher sets for one ``pretrain()`` (the ``--metrics-file``
  hook on ``training_log``, the script's ``is_distributed``), undone when it returns.
- ``collectives:<wrapper>``: one per active ``runtime.collective_wrapper.CollectiveWrapper`` (the watchdog's
  and the trace recorder's), started and stopped by its owner.

Undone in any order, the originals come back exactly: an entry replaced since by another recorded
entry hands its original on to that one (``undo`` of the inner of two stacked wrappers leaves the
outer in place, and the outer's undo restores what the inner found); an attribute that was
inherited or absent is deleted again; a function mode is taken off torch's stack wherever it sits.
Only an attribute that code outside this registry set since is left alone.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

MEGATRON = "megatron"
CPU = "cpu"
MEGATRON_LM_CPU = "megatron-lm-cpu"
MEGATRON_LM = "megatron-lm"

MISSING = object()  # what an attribute inherited from a class, or absent, was found as in its owner


@dataclass(eq=False)
class Patch:
    owner: object  # a module or a class (None for a function mode)
    name: str
    original: object  # what ``getattr`` gave: what a wrapper wraps
    replacement: object
    scope: str = MEGATRON
    kind: str = "attribute"  # "attribute"; "state": restored whatever it became; "mode": a torch function mode
    found: object = MISSING  # the owner's own value (its __dict__ entry), MISSING when inherited or absent
    everywhere: bool = False  # undo also rebinds modules that took the replacement by name later
    thread: int = field(default_factory=threading.get_ident)  # where a function mode was entered


_applied: list[Patch] = []
_lock = threading.RLock()


def _own(owner: object, name: str) -> object:
    if name == "__class__":  # an instance's class is its own, never inherited (a swap records the class found)
        return type(owner)
    try:
        namespace = vars(owner)
    except TypeError:  # no __dict__
        return getattr(owner, name, MISSING)
    return namespace.get(name, MISSING)


def replace(owner: object, name: str, replacement: object, scope: str = MEGATRON) -> Patch:
    """Set ``owner.name`` to ``replacement`` and record what it was."""
    with _lock:
        patch = Patch(owner, name, getattr(owner, name, None), replacement, scope, found=_own(owner, name))
        setattr(owner, name, replacement)
        _applied.append(patch)
        return patch


def replace_everywhere(original: object, replacement: object, name: str, scope: str = MEGATRON) -> int:
    """Replace ``name`` in every loaded module whose attribute is ``original``; how many were replaced.

    ``undo`` also puts ``original`` back in modules imported since that took the replacement by name
    (outside the replacement's own module).
    """
    count = 0
    with _lock:
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, name, None) is original:
                replace(module, name, replacement, scope).everywhere = True
                count += 1
    return count


def hook(
    owner: object, name: str, make: Callable[[Callable], Callable], everywhere: bool = False, scope: str = MEGATRON
) -> bool:
    """Wrap ``owner.name`` with ``make(original)`` once (idempotent); ``everywhere`` also rebinds loaded copies.

    The wrapper carries ``megatron_zb_hook`` and ``__wrapped__``. False when there is nothing to hook.
    """
    with _lock:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "megatron_zb_hook", False):
            return False
        wrapper = make(original)
        wrapper.megatron_zb_hook = True
        wrapper.__wrapped__ = original
        if everywhere:
            replace_everywhere(original, wrapper, name, scope)
        if getattr(owner, name) is original:
            replace(owner, name, wrapper, scope)
        return True


def remember(owner: object, name: str, scope: str) -> Patch:
    """Record ``owner.name`` as it is now, to be restored by ``undo(scope)`` whatever it has become (state)."""
    with _lock:
        value = getattr(owner, name, None)
        patch = Patch(owner, name, value, value, scope, kind="state", found=_own(owner, name))
        _applied.append(patch)
        return patch


def enter_mode(mode, scope: str) -> Patch:
    """Enter the torch function mode ``mode`` on this thread until ``undo(scope)`` (on this thread) exits it."""
    with _lock:
        mode.__enter__()
        patch = Patch(None, type(mode).__name__, None, mode, scope, kind="mode")
        _applied.append(patch)
        return patch


def in_force(patch: Patch) -> bool:
    """Whether ``patch`` is recorded and not undone; for an attribute, whether it still holds the replacement."""
    with _lock:
        if not any(entry is patch for entry in _applied):
            return False
        return patch.kind != "attribute" or _own(patch.owner, patch.name) is patch.replacement


def applied(scope: str | None = None) -> list[Patch]:
    """The replacements in force (of ``scope``, or all), oldest first."""
    with _lock:
        return [patch for patch in _applied if (scope is None or patch.scope == scope) and in_force(patch)]


def scopes() -> list[str]:
    """The scopes with anything recorded, in the order they first recorded."""
    with _lock:
        return list(dict.fromkeys(patch.scope for patch in _applied))


def undo(scope: str = MEGATRON) -> None:
    """Put back every original ``scope`` replaced (newest first); see the module docstring for the order rules."""
    with _lock:
        mine = [patch for patch in _applied if patch.scope == scope]
        for patch in mine:
            if patch.kind == "mode":
                _check_mode_thread(patch)
        for patch in reversed(mine):
            _revert(patch)
        _rebind_late_importers([patch for patch in mine if patch.everywhere])


def undo_all() -> None:
    """Undo every scope, the latest recorded first."""
    with _lock:
        for scope in reversed(scopes()):
            undo(scope)


def revert(patch: Patch) -> None:
    """Undo one recorded ``patch`` (as ``undo`` would)."""
    with _lock:
        if patch.kind == "mode":
            _check_mode_thread(patch)
        _revert(patch)
        if patch.everywhere:
            _rebind_late_importers([patch])


def _revert(patch: Patch) -> None:
    if not any(entry is patch for entry in _applied):
        return
    _applied.remove(patch)
    if patch.kind == "mode":
        _exit_mode(patch.replacement)
        return
    if patch.kind == "state" or _own(patch.owner, patch.name) is patch.replacement:
        _restore(patch.owner, patch.name, patch.found)
        return
    above = next(
        (
            entry
            for entry in _applied
            if entry.kind == "attribute"
            and entry.owner is patch.owner
            and entry.name == patch.name
            and entry.found is patch.replacement
        ),
        None,
    )
    if above is not None:  # stacked on ours and still in force: it restores what we found
        above.found, above.original = patch.found, patch.original


def _restore(owner: object, name: str, found: object) -> None:
    if found is MISSING:
        if _own(owner, name) is not MISSING:
            delattr(owner, name)
    else:
        setattr(owner, name, found)


def _rebind_late_importers(patches: list[Patch]) -> None:
    """Modules imported while ``patches`` were in force bound their replacements by name: give them the originals."""
    if not patches:
        return
    originals = {}
    for patch in patches:
        originals[(patch.name, id(patch.replacement))] = (patch.replacement, patch.original)
    for module_name, module in list(sys.modules.items()):
        if module is None:
            continue
        for (name, _), (replacement, original) in originals.items():
            if module_name != getattr(replacement, "__module__", None) and _own(module, name) is replacement:
                setattr(module, name, original)


def _check_mode_thread(patch: Patch) -> None:
    if patch.thread != threading.get_ident() and any(entry is patch for entry in _applied):
        raise RuntimeError(
            f"the {patch.name} torch function mode of scope {patch.scope!r} was entered on another thread; "
            "torch keeps one mode stack per thread: undo it on that thread"
        )


def _exit_mode(mode) -> None:
    """Take ``mode`` off this thread's torch function-mode stack, keeping the modes entered above it."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

    stack = _get_current_function_mode_stack()
    if not any(entry is mode for entry in stack):
        return  # exited already
    above = []
    while stack[-1] is not mode:
        above.append(_pop_mode())
        stack.pop()
    mode.__exit__(None, None, None)
    for entry in reversed(above):
        _push_mode(entry)
