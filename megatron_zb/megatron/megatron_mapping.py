"""Where megatron's own looping placement (block = virtual stage x pipeline size + rank) and a schedule's differ.

Megatron-LM builds chunks, data loading and the embedding group by its looping mapping; a placement that maps
blocks otherwise (the V) is "foreign" and needs ``placement_hooks``. Read by the flags (``args``), the model
(``gpt_model``) and the hooks alike.
"""

from __future__ import annotations

import argparse

from ..schedule.placement import Placement
from .layer_split import layers_per_block

# Megatron-LM's layout flags, which place layers by its looping mapping (flag, args field).
MEGATRON_LAYOUT_FLAGS = (
    ("--pipeline-model-parallel-layout", "pipeline_model_parallel_layout"),
    ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
    ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
    ("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split"),
    ("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split"),
)


def uses_megatron_mapping(placement: Placement) -> bool:
    """Does megatron-core's own (rank, vp stage) -> block mapping match this placement?"""
    pp = placement.pp
    return all(
        placement.blocks[block] == (block % pp, placement.chunk_base + block // pp)
        for block in range(placement.num_stages)
    )


def foreign_placement(placement: Placement | None) -> Placement | None:
    """``placement`` when megatron's own (rank, vp stage) -> block mapping is not it, else None."""
    return None if placement is None or uses_megatron_mapping(placement) else placement


def prepare_args(args: argparse.Namespace, placement: Placement, schedule: str) -> None:
    """Megatron-LM's parsed arguments for ``placement``; ValueError for flags that cannot work with it.

    Runs right after Megatron-LM's ``validate_args``, before any process group exists.
    """
    if foreign_placement(placement) is None:
        return
    given = [flag for flag, field in MEGATRON_LAYOUT_FLAGS if getattr(args, field, None)]
    if given:
        raise ValueError(
            f"{schedule} places its layer blocks itself ({placement.kind} placement: {_blocks_text(placement)}); "
            f"{', '.join(given)} {'lays' if len(given) == 1 else 'lay'} layers out by megatron's looping placement "
            f"(block = virtual stage x pipeline size + rank): drop {'it' if len(given) == 1 else 'them'}"
        )
    layers = layers_per_block(args.num_layers, placement, bool(getattr(args, "allow_padding_num_layers", False)))
    if len(set(layers)) > 1:
        even = 2 * placement.num_stages
        raise ValueError(
            f"--allow-padding-num-layers: Megatron-LM builds its TransformerConfig with --num-layers split evenly "
            f"over the {placement.num_stages} layer blocks before megatron-zb places them, so {schedule} on "
            f"Megatron-LM needs --num-layers divisible by {placement.num_stages} (e.g. {even}); uneven blocks "
            f"{layers} run with `megatron-zb train`"
        )
    args.virtual_pipeline_model_parallel_size = placement.chunks if placement.chunks > 1 else None


def _blocks_text(placement: Placement) -> str:
    """Where the rank 0 chunks sit, e.g. 'rank 0 holds layer blocks 0 and 7'."""
    blocks = [str(placement.stage_of(0, placement.chunk_base + chunk)) for chunk in range(placement.chunks)]
    listed = ", ".join(blocks[:-1]) + " and " + blocks[-1] if len(blocks) > 1 else blocks[0]
    return f"rank 0 holds layer blocks {listed} of {placement.num_stages}"
