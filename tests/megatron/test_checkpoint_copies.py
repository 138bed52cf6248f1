"""Megatron-LM's fully parallel checkpoint save where a placement keeps both embedding copies on one rank.

megatron-core's fully parallel save marks every local entry of a (key, offset) it gives a rank as the main replica;
the V's rank 0 holds the embedding and the tied output copy saved under the embedding's key, so at data parallelism 2
the save wrote it twice and the sharding check refused the checkpoint (scripts/moe_matrix.py, zb-v at EP 2).
"""

from __future__ import annotations

import argparse

from megatron_zb.megatron.megatron_mapping import serial_checkpoint_copies
from megatron_zb.schedule.placement import interleaved, linear, v_shape


def megatron_args(**given) -> argparse.Namespace:
    """Megatron-LM's validated fields this reads, with its defaults (fully parallel save on, load off)."""
    fields = {
        "untie_embeddings_and_output_weights": False,
        "mtp_num_layers": None,
        "data_parallel_size": 2,
        "context_parallel_size": 1,
        "ckpt_fully_parallel_save": True,
        "ckpt_fully_parallel_load": False,
        "save": "/ckpt",
        "load": None,
    }
    return argparse.Namespace(**{**fields, **given})


def test_v_with_tied_copies_and_data_parallelism_saves_without_the_fully_parallel_save() -> None:
    args = megatron_args(load="/ckpt", ckpt_fully_parallel_load=True)
    note = serial_checkpoint_copies(args, v_shape(2))
    assert args.ckpt_fully_parallel_save is False and args.ckpt_fully_parallel_load is False
    assert note.startswith("ckpt-fully-parallel-save and ckpt-fully-parallel-load turned off")


def test_mtp_keeps_a_copy_with_untied_embeddings() -> None:
    args = megatron_args(untie_embeddings_and_output_weights=True, mtp_num_layers=1)
    assert serial_checkpoint_copies(args, v_shape(4)) is not None
    assert args.ckpt_fully_parallel_save is False


def test_left_alone_where_the_fully_parallel_save_is_exact_or_unused() -> None:
    cases = {
        "megatron's placements: the copies on the first and the last rank": (linear(2), {}),
        "interleaved": (interleaved(2, 2), {}),
        "untied, no MTP": (v_shape(2), {"untie_embeddings_and_output_weights": True}),
        "one data-parallel rank": (v_shape(2), {"data_parallel_size": 1}),
        "no save": (v_shape(2), {"save": None}),
        "already off": (v_shape(2), {"ckpt_fully_parallel_save": False}),
    }
    for why, (placement, given) in cases.items():
        args = megatron_args(**given)
        before = vars(args).copy()
        assert serial_checkpoint_copies(args, placement) is None, why
        assert vars(args) == before, why


def test_context_parallelism_splits_the_save_too() -> None:
    args = megatron_args(data_parallel_size=1, context_parallel_size=2)
    assert serial_checkpoint_copies(args, v_shape(2)) is not None
