"""Megatron-LM's own ``pretrain()`` in this process, with the zero-bubble flags and schedules.

The checkout's ``pretrain_gpt.py`` supplies the datasets, model provider and forward step, its ``pretrain()`` the
loop, logging and checkpoints; megatron-zb adds its flags, registers the schedule behind
``get_forward_backward_func()`` and checks the flags before any process group starts (``validation.py``). Both
``pretrain()`` signatures are driven: up to Megatron-LM 0.17 it parses the flags itself (``args_defaults=``,
``extra_args_provider=``); from 0.18 it takes a config container first, built by the script from
``parse_and_validate_args()``, as pretrain_gpt.py's ``__main__`` does.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from functools import partial

from .. import patching
from ..megatron.args import add_args
from .checkout import pretrain_gpt_module, takes_config_container
from .validation import check_flags_before_init


def pretrain_here(argv: Sequence[str], metrics_file: str | None = None) -> None:
    """Run Megatron-LM's pretrain() in this process (torch.distributed set up by it, or already)."""
    script = pretrain_gpt_module()
    from megatron.training import training

    from ..megatron.install import install

    install()
    check_flags_before_init()
    try:
        if metrics_file:
            _write_metrics(training, metrics_file)
        _pretrain(script, training, argv)
    finally:
        patching.undo(patching.MEGATRON_LM)  # the metrics hook is this run's


def _pretrain(script, training, argv: Sequence[str]) -> None:
    from megatron.core.enums import ModelType

    # Megatron-LM parses sys.argv; pretrain_here undoes this with the run's other patches.
    patching.replace(sys, "argv", [getattr(script, "__file__", "pretrain_gpt.py"), *argv], patching.MEGATRON_LM)
    datasets = script.train_valid_test_datasets_provider
    patching.replace(datasets, "is_distributed", True, patching.MEGATRON_LM)  # as pretrain_gpt.py's __main__ sets it
    extra = {}
    if getattr(script, "get_embedding_ranks", None) is not None:
        extra["get_embedding_ranks"] = script.get_embedding_ranks
    if takes_config_container(training.pretrain):
        config = _config_container(script)
        training.pretrain(config, datasets, ModelType.encoder_or_decoder, script.forward_step, **extra)
        return
    training.pretrain(
        datasets,
        _model_provider(script),
        ModelType.encoder_or_decoder,
        script.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_args,
        **extra,
    )


def _config_container(script):
    """What pretrain_gpt.py's ``__main__`` builds before calling a config-container pretrain()."""
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    return pretrain_cfg_container_from_args(args, gpt_config_from_args(args))


def _model_provider(script):
    """The provider pretrain_gpt.py passes to pretrain(), in the older and the newer layout."""
    builder = getattr(script, "gpt_builder", None)
    if builder is not None:
        return partial(script.model_provider, builder)
    return script.model_provider


def _write_metrics(training, path: str) -> None:
    """``--metrics-file``: one JSON line per iteration from Megatron-LM's ``training_log`` (logging rank only).

    Recorded under the ``megatron-lm`` scope, which ``pretrain_here`` undoes when its run returns.
    """
    original = training.training_log
    if getattr(original, "megatron_zb_metrics", False):
        return
    from megatron.training import get_args

    from ..megatron.install import active_settings
    from ..megatron.placement_hooks import last_mtp_losses
    from ..training.measured import MetricsWriter

    writer = MetricsWriter(path)
    last = [time.perf_counter()]

    @functools.wraps(original)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        now = time.perf_counter()
        settings = active_settings()
        loss = loss_dict.get("lm loss") if loss_dict else None
        grad_norm = rest[3] if len(rest) > 3 else kwargs.get("grad_norm")
        skipped = rest[2] if len(rest) > 2 else kwargs.get("skipped_iter")
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)
        mtp = {"mtp_loss": last_mtp_losses()} if getattr(get_args(), "mtp_num_layers", None) else {}
        writer.write(
            iteration,
            None if loss is None else float(loss),
            now - last[0],
            None,
            settings.schedule if settings is not None else "megatron-core",
            grad_norm=None if grad_norm is None else float(grad_norm),
            learning_rate=None if learning_rate is None else float(learning_rate),
            skipped=bool(skipped),
            **mtp,  # training_log has just tracked them (Megatron-LM's "mtp_N loss")
        )
        last[0] = now
        return result

    training_log.megatron_zb_metrics = True
    patching.replace(training, "training_log", training_log, patching.MEGATRON_LM)
