"""The one record of every megatron-core / Megatron-LM attribute megatron-zb replaces.

Megatron-LM binds many functions by name at import time (``from megatron.training.utils import
is_first_or_last_pipeline_stage`` in pretrain_gpt.py, ...), so a hook has to replace every loaded
copy, and the source attribute so later importers bind it too. Each replacement is recorded
here with what it replaced; ``undo()`` puts the originals back (``megatron_zb.uninstall()``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    owner: object  # a module or a class
    name: str
    original: object
    replacement: object


_applied: list[Patch] = []


def replace(owner: object, name: str, replacement: object) -> Patch:
    """Set ``owner.name`` to ``replacement`` and record what it was."""
    patch = Patch(owner, name, getattr(owner, name), replacement)
    setattr(owner, name, replacement)
    _applied.append(patch)
    return patch


def replace_everywhere(original: object, replacement: object, name: str) -> int:
    """Replace ``name`` in every loaded module whose attribute is ``original``; how many were replaced."""
    count = 0
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, name, None) is original:
            replace(module, name, replacement)
            count += 1
    return count


def hook(owner: object, name: str, make: Callable[[Callable], Callable], everywhere: bool = False) -> bool:
    """Wrap ``owner.name`` with ``make(original)`` once (idempotent); ``everywhere`` also rebinds loaded copies.

    The wrapper carries ``megatron_zb_hook`` and ``__wrapped__``. False when there is nothing to hook.
    """
    original = getattr(owner, name, None)
    if original is None or getattr(original, "megatron_zb_hook", False):
        return False
    wrapper = make(original)
    wrapper.megatron_zb_hook = True
    wrapper.__wrapped__ = original
    if everywhere:
        replace_everywhere(original, wrapper, name)
    if getattr(owner, name) is original:
        replace(owner, name, wrapper)
    return True


def applied() -> list[Patch]:
    """The replacements in force, oldest first."""
    return [patch for patch in _applied if getattr(patch.owner, patch.name, None) is patch.replacement]


def undo() -> None:
    """Put back every original this module replaced (newest first); attributes changed since are left alone."""
    while _applied:
        patch = _applied.pop()
        if getattr(patch.owner, patch.name, None) is patch.replacement:
            setattr(patch.owner, patch.name, patch.original)
