"""Megatron-LM's parsed arguments, when its training package set them, and the zero-bubble settings they select.

Read by ``install`` (which schedule ``get_forward_backward_func`` runs) and the placement hooks alike.
"""

from __future__ import annotations

import sys

from .args import ZeroBubbleSettings, schedule_settings

_from_args: dict = {}


def megatron_lm_args():
    """Megatron-LM's parsed arguments when its training package is loaded and they are set."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None
    return args if args is not None and hasattr(args, "enable_zero_bubble") else None


def megatron_lm_settings() -> ZeroBubbleSettings | None:
    """The settings Megatron-LM's parsed arguments select (``configure()`` aside); None without them."""
    args = megatron_lm_args()
    if args is None:
        return None
    key = id(args)
    if key not in _from_args or _from_args[key][0] is not args:  # the args kept too: an id can be reused
        _from_args.clear()
        _from_args[key] = (args, schedule_settings(args))
    return _from_args[key][1]


def forget() -> None:
    """Drop the cached settings (``uninstall()``): the next arguments are read anew."""
    _from_args.clear()
