"""Which Megatron-LM runs: a checkout's pretrain_gpt.py, or the installed megatron-core's own ``megatron.training``.

A checkout comes from ``--megatron-lm PATH``, MEGATRON_LM_PATH or PYTHONPATH; with MEGATRON_LM_USE_INSTALLED=1 the
installed megatron-core >= 0.17 wheel's ``megatron/training`` and megatron-core win and the checkout gives its
scripts only. With no checkout, the wheel's loop runs with megatron-zb's GPT providers (``script.py``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

_CHECKOUT_MODULES = ("megatron", "pretrain_gpt", "gpt_builders", "model_provider")


class MegatronLMMissing(RuntimeError):
    """No importable Megatron-LM checkout, or a package it needs is not installed."""


def takes_config_container(pretrain) -> bool:
    """Megatron-LM >= 0.18: ``pretrain(cfg_container, datasets, model_type, forward_step, ...)``."""
    return next(iter(inspect.signature(pretrain).parameters), None) == "cfg_container"


def pretrain_gpt_module():
    """The checkout's pretrain_gpt.py; with no checkout, the installed ``megatron.training`` and our providers."""
    root = os.environ.get("MEGATRON_LM_PATH")
    if root and root not in sys.path:
        if os.environ.get("MEGATRON_LM_USE_INSTALLED") == "1":
            sys.path.append(root)  # the installed megatron.core/megatron.training win; the checkout's scripts
        else:
            sys.path.insert(0, root)
    try:
        importlib.import_module("megatron.training")
    except ImportError as error:
        raise _missing(error, root) from None
    try:
        return importlib.import_module("pretrain_gpt")
    except ImportError as error:
        if root or getattr(error, "name", None) != "pretrain_gpt":
            raise _missing(error, root) from None
    from . import script

    return script


def uses_own_providers() -> bool:
    """No checkout: the installed megatron-core's ``megatron.training`` runs with ``script.py``'s providers."""
    from . import script

    return pretrain_gpt_module() is script


def _missing(error: ImportError, root: str | None) -> MegatronLMMissing:
    """Name a missing package as such; only a missing ``megatron.training`` or script means no checkout."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    if name and name not in _CHECKOUT_MODULES:
        return MegatronLMMissing(
            f"Megatron-LM needs the package '{name}', which is not installed ({error}); install Megatron-LM's "
            "pure-Python dependencies with `pip install 'megatron-zb[megatron-lm]'`"
        )
    where = f"MEGATRON_LM_PATH={root} has none" if root else "none found"
    return MegatronLMMissing(
        f"--megatron-lm needs a Megatron-LM checkout (megatron.training and pretrain_gpt.py): give its path "
        f"(--megatron-lm PATH), set MEGATRON_LM_PATH or put it on PYTHONPATH; {where} ({error}). Without it, drop "
        "--megatron-lm to use megatron-zb's own loop"
    )
