"""Megatron-LM's own ``pretrain()`` with the zero-bubble flags: ``python -m megatron_zb.pretrain_gpt --megatron-lm``.

Needs a Megatron-LM checkout importable (its root on PYTHONPATH, or MEGATRON_LM_PATH): its
``pretrain_gpt.py`` supplies the datasets, model provider and forward step, its ``pretrain()``
the loop, logging and checkpoints; we add our flags, register the schedule behind
``get_forward_backward_func()`` and check the flags before any process group starts.
Megatron-LM's model provider and ``get_batch`` place the embedding on the first and the
loss on the last pipeline rank, so V-shape schedules are refused on this path: they run
with megatron-zb's own loop (``megatron-zb train``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from functools import partial

from .megatron.args import add_args, schedule_settings


class MegatronLMMissing(RuntimeError):
    """No importable Megatron-LM checkout."""


def run(argv: Sequence[str]) -> int:
    script = _pretrain_gpt_module()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from .megatron.install import install

    install()
    check_flags_before_init()
    sys.argv = [getattr(script, "__file__", "pretrain_gpt.py"), *argv]
    datasets = script.train_valid_test_datasets_provider
    datasets.is_distributed = True  # as pretrain_gpt.py's __main__ sets it
    pretrain(
        datasets,
        _model_provider(script),
        ModelType.encoder_or_decoder,
        script.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_args,
    )
    return 0


def _pretrain_gpt_module():
    root = os.environ.get("MEGATRON_LM_PATH")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    try:
        importlib.import_module("megatron.training")
        return importlib.import_module("pretrain_gpt")
    except ImportError as error:
        raise MegatronLMMissing(
            f"--megatron-lm needs a Megatron-LM checkout (megatron.training and pretrain_gpt.py) on PYTHONPATH or in "
            f"MEGATRON_LM_PATH ({error}); without it, drop --megatron-lm to use megatron-zb's own loop"
        ) from None


def _model_provider(script):
    """The provider pretrain_gpt.py passes to pretrain(), in the older and the newer layout."""
    builder = getattr(script, "gpt_builder", None)
    if builder is not None:
        return partial(script.model_provider, builder)
    return script.model_provider


def check_flags_before_init() -> None:
    """Refuse bad zero-bubble flags in Megatron-LM's ``validate_args``, before torch.distributed starts.

    Otherwise they fail at the first ``get_forward_backward_func()`` call, on every rank, after
    the process groups, model and optimizer were built. Wraps the ``validate_args`` that
    ``initialize_megatron`` calls right after parsing, and the one in ``megatron.training.arguments``
    where newer checkouts parse before ``pretrain()``; calling this again does nothing.
    """
    from megatron.training import initialize

    modules = [initialize, sys.modules.get("megatron.training.arguments")]
    for module in modules:
        validate_args = getattr(module, "validate_args", None)
        if validate_args is not None and not getattr(validate_args, "megatron_zb_checked", False):
            module.validate_args = _checked(validate_args)


def _checked(validate_args):
    """Megatron-LM's validate_args, then ours: runs before torch.distributed is initialised."""

    def validate(args, *rest, **kwargs):
        found = validate_args(args, *rest, **kwargs)
        try:
            settings = schedule_settings(found if found is not None else args)
        except ValueError as error:
            raise SystemExit(f"megatron-zb: {error}") from None
        if settings is not None and settings.placement.kind == "v":
            raise SystemExit(
                f"megatron-zb: {settings.schedule} needs the V-shape model placement, which Megatron-LM's "
                "pretrain_gpt model provider does not build; run it with `megatron-zb train`, or choose a schedule "
                "with Megatron's placement here (zb-1p, zb-2p, zb-h1, zb-h2, 1f1b, interleaved-1f1b)"
            )
        return found

    validate.megatron_zb_checked = True
    return validate
