"""Wrapping every torch.distributed collective while active, and putting each back: the base of the
training side's watchdog and trace recorder and of the runtime's overlapped passes (``overlap.py``).

It replaces the attributes of ``torch.distributed`` (how megatron-core calls them), of
``torch.distributed.distributed_c10d`` (where one collective calls another: only the outermost call
reaches the wrapper) and the module-level aliases megatron-core takes at import
(``dist_all_gather_func = torch.distributed.all_gather_into_tensor``), and puts every one back on
``stop()``: each replacement is recorded in ``megatron_zb.patching`` under the wrapper's own scope.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
from collections.abc import Callable, Iterable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import patching

# Every collective of torch.distributed; names missing from the installed torch are skipped.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "reduce", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base",
    "_reduce_scatter_base",
)  # fmt: skip
MODULES = (dist, c10d)
_wrapper_ids = itertools.count(1)


class CollectiveWrapper:
    """Replaces every torch.distributed collective with a wrapper while active; ``stop()`` puts them back.

    Subclasses say what happens around a call in ``_call``; only the outermost collective of a
    thread reaches it (``all_gather_object`` calling ``all_gather`` is one call). Wrappers of
    different subclasses stack (a recorder inside the watchdog); two active ones of one class
    are refused. ``marker`` names the attribute that ties a wrapper function to its owner.

    Each wrapper records its replacements in ``patching`` under a scope of its own
    (``collectives:<class>#<n>``): its lifetime is one run, started and stopped here, which no
    ``megatron_zb.uninstall()`` or ``cpu.disable()`` may cut short; the registry still lists what
    it holds replaced, and puts back what it found.
    """

    marker = "_collective_wrapper"

    def __init__(self, ops: Iterable[str] = COLLECTIVES, alias_prefixes: tuple[str, ...] = ("megatron.",)):
        self.ops = tuple(op for op in ops if hasattr(dist, op))
        self.alias_prefixes = alias_prefixes
        self.scope = f"collectives:{type(self).__name__}#{next(_wrapper_ids)}"
        self._saved: list[patching.Patch] = []  # the registry's entries, while active
        self._local = threading.local()  # call depth per thread: only outermost calls reach _call

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def start(self) -> None:
        if self.active:
            raise RuntimeError(f"this {type(self).__name__} is already active")
        originals = {op: getattr(dist, op) for op in self.ops}
        wrapped = [op for op, fn in originals.items() if getattr(fn, self.marker, None) is not None]
        if wrapped:
            raise RuntimeError(
                f"torch.distributed.{wrapped[0]} is already wrapped by another active {type(self).__name__}"
            )
        wrappers = {id(fn): self._wrap(op, fn) for op, fn in originals.items()}
        for module in (*MODULES, *self._alias_modules()):
            for attribute, value in list(vars(module).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None and value is wrapper.__wrapped__:
                    self._saved.append(patching.replace(module, attribute, wrapper, self.scope))

    def stop(self) -> None:
        """Put back every attribute ``start()`` replaced (a no-op when not active).

        A wrapper started after this one wraps its wrappers: it is stopped first (a recorder left
        running when a run fails stops with the watchdog), so every attribute ends as found.
        """
        saved, self._saved = self._saved, []
        for patch in saved:
            above = getattr(getattr(patch.owner, patch.name, None), "_collective_owner", None)
            if above is not None and above is not self and above.active:
                above.stop()
        patching.undo(self.scope)

    def _alias_modules(self) -> list:
        return [
            module
            for name, module in list(sys.modules.items())
            if module is not None and name.startswith(self.alias_prefixes) and module not in MODULES
        ]

    def _call(self, op: str, original, bound: Callable[[], dict], args: tuple, kwargs: dict):
        """Run ``original(*args, **kwargs)``; ``bound()`` gives the call's arguments by name."""
        raise NotImplementedError

    def _wrap(self, op: str, original):
        signature = inspect.signature(original)
        local = self._local

        def wrapped(*args, **kwargs):
            if getattr(local, "depth", 0) or not self.active:  # nested, or an alias kept past stop()
                return original(*args, **kwargs)
            local.depth = 1
            try:
                return self._call(op, original, lambda: signature.bind(*args, **kwargs).arguments, args, kwargs)
            finally:
                local.depth = 0

        wrapped.__wrapped__ = original
        wrapped.__name__ = wrapped.__qualname__ = op
        wrapped.__doc__ = original.__doc__
        setattr(wrapped, self.marker, self)
        wrapped._collective_owner = self  # whichever subclass: what stop() finds stacked on its own
        return wrapped
