"""megatron-zb's checks inside Megatron-LM's ``validate_args``: bad zero-bubble flags end the run before
torch.distributed starts, and a placement Megatron-LM does not build itself (V) gets its arguments set."""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import sys

from .. import patching
from ..megatron.args import enabled, schedule_settings, zero_bubble_notes
from ..megatron.megatron_mapping import (
    PADDED_NOTE,
    moe_overlap_as_pairs,
    pad_by_megatron_split,
    prepare_args,
    serial_checkpoint_copies,
)
from ..training.checks import writable_file


def check_flags_before_init() -> None:
    """Refuse bad zero-bubble flags in Megatron-LM's ``validate_args``, before torch.distributed starts.

    Otherwise they fail at the first ``get_forward_backward_func()`` call, on every rank, after
    the process groups, model and optimizer were built. For a placement megatron does not build
    itself (V) it also sets the arguments Megatron-LM builds the chunks from
    (``megatron_mapping.prepare_args``). Wraps the ``validate_args`` that
    ``initialize_megatron`` calls right after parsing, and the one in ``megatron.training.arguments``
    where newer checkouts parse before ``pretrain()``; calling this again does nothing.
    """
    from megatron.training import initialize

    with contextlib.suppress(ImportError):
        importlib.import_module("megatron.training.arguments")
    modules = [initialize, sys.modules.get("megatron.training.arguments")]
    for module in modules:
        validate_args = getattr(module, "validate_args", None)
        if validate_args is not None and not getattr(validate_args, "megatron_zb_checked", False):
            patching.replace(module, "validate_args", _checked(validate_args), patching.MEGATRON)


def _checked(validate_args):
    """Megatron-LM's validate_args, then ours: runs before torch.distributed is initialised."""

    def validate(args, *rest, **kwargs):
        try:
            padded = pad_layers(args)
            overlap = moe_overlap_as_pairs(args, enabled(args))
        except ValueError as error:
            raise SystemExit(f"megatron-zb: {error}") from None
        notes = ([PADDED_NOTE] if padded else []) + ([overlap] if overlap else [])
        if getattr(args, "rank", 0) == 0:
            for note in notes:
                print(f"megatron-zb: note: {note}", file=sys.stderr, flush=True)
        found = validate_args(args, *rest, **kwargs)
        checked = found if found is not None else args
        try:
            notes = check_zero_bubble(checked)
        except ValueError as error:
            raise SystemExit(f"megatron-zb: {error}") from None
        if getattr(checked, "rank", 0) == 0:
            for note in [*notes, *zero_bubble_notes(checked)]:
                print(f"megatron-zb: note: {note}", file=sys.stderr, flush=True)
        return found

    validate.megatron_zb_checked = True
    return validate


def pad_layers(args: argparse.Namespace) -> bool:
    """Before Megatron-LM's ``validate_args``: ``--allow-padding-num-layers`` as its own uneven split where the
    schedule's placement is Megatron-LM's (``megatron_mapping.pad_by_megatron_split``); whether it was set.

    A line megatron-zb's checks refuse is refused here, before Megatron-LM's count check can hide why.
    """
    if not getattr(args, "allow_padding_num_layers", False):
        return False
    settings = schedule_settings(copy.copy(args))
    if settings is None:
        return False
    return pad_by_megatron_split(args, settings.placement, settings.schedule)


def check_zero_bubble(args: argparse.Namespace) -> list[str]:
    """megatron-zb's checks of Megatron-LM's validated arguments; sets what a foreign placement needs (V). The
    notes to print: what was set."""
    settings = schedule_settings(args)
    if settings is None:
        return []
    if settings.costs_file:
        writable_file("--zero-bubble-save-costs", settings.costs_file)
    if settings.shared:
        _check_copies(args, settings.schedule)
    prepare_args(args, settings.placement, settings.schedule, settings.placements)
    note = serial_checkpoint_copies(args, settings.placement)
    return [note] if note else []


def _check_copies(args: argparse.Namespace, schedule: str) -> None:
    """What a schedule keeping two copies of each block (BitPipe) needs of a Megatron-LM line.

    The copies must start equal: Megatron-LM draws each rank's weights from its own seed, so only
    ``--zero-bubble-placement-independent-init`` (every weight from the seed and its name) gives both copies, on two
    ranks, the same weights. Router state kept per copy is refused as by the launcher (``moe_checks``).
    """
    from ..training.moe_checks import check_replicated_routers

    if not getattr(args, "zero_bubble_placement_independent_init", False):
        raise ValueError(
            f"--pipeline-schedule {schedule} keeps two copies of each layer block, on two ranks, which must start "
            "from the same weights: add --zero-bubble-placement-independent-init (each weight drawn from --seed and "
            "its name, as the launcher does)"
        )
    check_replicated_routers(args, schedule)
