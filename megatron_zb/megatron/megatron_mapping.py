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


def prepare_args(
    args: argparse.Namespace, placement: Placement, schedule: str, pipes: tuple[Placement, ...] = ()
) -> None:
    """Megatron-LM's parsed arguments for ``placement``; ValueError for flags that cannot work with it.

    Runs right after Megatron-LM's ``validate_args``, before any process group exists. ``pipes`` (``placement``
    first; BitPipe: two): Megatron-LM builds one model list holding every pipe's chunks.
    """
    if foreign_placement(placement) is None:
        return
    given = [flag for flag, field in MEGATRON_LAYOUT_FLAGS if field not in ENDS and getattr(args, field, None)]
    if given:
        raise ValueError(
            f"{schedule} places its layer blocks itself ({placement.kind} placement: {_blocks_text(placement)}); "
            f"{', '.join(given)} {'lays' if len(given) == 1 else 'lay'} layers out by megatron's looping placement "
            f"(block = virtual stage x pipeline size + rank): drop {'it' if len(given) == 1 else 'them'}"
        )
    first, last = (getattr(args, field, None) for field in ENDS)
    pad = bool(getattr(args, "allow_padding_num_layers", False))
    layers = layers_per_block(args.num_layers, placement, pad, first, last)
    if len(set(layers)) > 1 and first is None and last is None:
        raise ValueError(_uneven_foreign(placement, schedule, layers))
    if first is not None or last is not None:
        # the placement's layout builds these counts; megatron-core's config would split by its own placement
        args.zero_bubble_block_layers = tuple(layers)
        args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    chunks = sum(pipe.chunks for pipe in pipes or (placement,))
    args.virtual_pipeline_model_parallel_size = chunks if chunks > 1 else None


def serial_checkpoint_copies(args: argparse.Namespace, placement: Placement) -> str | None:
    """Turn off Megatron-LM's fully parallel checkpoint save and load where ``placement`` keeps both embedding
    copies (tied output layer, MTP) on one rank and data parallelism splits the save; the note to print, or None.

    megatron-core's fully parallel save gives each (key, offset) one saving rank in the data-parallel group and
    marks every local entry of that key as the main replica: the output chunk's copy is saved under the embedding's
    key, so the chosen rank would save it twice and the sharding check refuses the checkpoint. The plain save
    marks the copy as a replica, as the last stage's copy is on megatron's own placement; the checkpoint is the
    same (the save is spread over the data-parallel ranks no more).
    """
    if placement.num_stages < 2 or placement.rank_of(0) != placement.rank_of(placement.num_stages - 1):
        return None
    copies = not getattr(args, "untie_embeddings_and_output_weights", False) or getattr(args, "mtp_num_layers", None)
    splits = (getattr(args, "data_parallel_size", 1) or 1) * (getattr(args, "context_parallel_size", 1) or 1) > 1
    fields = {"--save": "ckpt_fully_parallel_save", "--load": "ckpt_fully_parallel_load"}
    given = [field for flag, field in fields.items() if getattr(args, field, False) and getattr(args, flag[2:], None)]
    if not (copies and splits and given):
        return None
    for field in given:
        setattr(args, field, False)
    return (
        f"{' and '.join(field.replace('_', '-') for field in given)} turned off: this placement keeps the embedding "
        "and its tied copy on one rank, and megatron-core's fully parallel save would write that copy twice "
        "(checkpoints are the same, written by the first data-parallel rank)"
    )


MOE_OVERLAP_NOTE = (
    "--overlap-moe-expert-parallel-comm means --zero-bubble-overlap-f-b under a megatron-zb schedule: megatron-core's "
    "CUDA-stream overlap belongs to its own combined 1F1B, which the schedule replaces; the re-plan places overlapped "
    "F&B pairs that hide the same all-to-all (megatron-core's flag turned off)"
)


def moe_overlap_as_pairs(args: argparse.Namespace, scheduled: bool) -> str | None:
    """Before Megatron-LM's ``validate_args``: its ``--overlap-moe-expert-parallel-comm`` under a megatron-zb
    schedule (``scheduled``: ``args.enabled``) as our overlapped F&B pairs; the note to print, or None where the line
    does not ask for it.

    Without a megatron-zb schedule the flag is megatron-core's own (a CUDA-stream overlap) and is left alone.
    megatron-core's conditions stay: EP of 2 or more and no full recomputation (``args._overlap_f_b`` refuses
    those), and a dispatcher with an all-to-all (refused here).
    """
    if not getattr(args, "overlap_moe_expert_parallel_comm", False) or not scheduled:
        return None
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if dispatcher not in ("alltoall", "flex"):
        raise ValueError(
            "--overlap-moe-expert-parallel-comm hides the all-to-all of megatron-core's alltoall and flex "
            f"dispatchers; --moe-token-dispatcher-type {dispatcher} has none: give alltoall, or drop the flag"
        )
    args.overlap_moe_expert_parallel_comm = False
    args.zero_bubble_overlap_f_b = True
    return MOE_OVERLAP_NOTE


# Megatron-LM's fields of the first and the last pipeline stage's layer counts: on a placement megatron does not
# build itself they are the first and the last layer block's (``prepare_args``)
ENDS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")


def block_layers(args: argparse.Namespace | None, num_layers: int, placement: Placement) -> list[int]:
    """Decoder layers of each block of a placement megatron does not build: those ``prepare_args`` fixed from the
    first and last counts, else an even split."""
    fixed = getattr(args, "zero_bubble_block_layers", None) if args is not None else None
    if fixed is not None and len(fixed) == placement.num_stages and sum(fixed) == num_layers:
        return list(fixed)
    return layers_per_block(num_layers, placement)


def pad_by_megatron_split(args: argparse.Namespace, placement: Placement, schedule: str) -> bool:
    """``--allow-padding-num-layers`` as Megatron-LM's own uneven split, set before its ``validate_args`` runs.

    The padded split (the embedding's and the loss's blocks one layer fewer) is the one Megatron-LM builds with
    ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`` on its looping placement,
    whose validate_args would otherwise refuse a --num-layers that the blocks do not divide. Returns whether it set
    them; ValueError for a placement Megatron-LM does not build (V), which cannot take uneven blocks from it.
    """
    if not getattr(args, "allow_padding_num_layers", False):
        return False
    if any(getattr(args, field, None) for _, field in MEGATRON_LAYOUT_FLAGS):
        return False  # the line lays its layers out with Megatron-LM's own flags
    layers = layers_per_block(args.num_layers, placement, True)
    if len(set(layers)) == 1:
        return False
    if foreign_placement(placement) is not None:
        raise ValueError(_uneven_foreign(placement, schedule, layers))
    args.account_for_embedding_in_pipeline_split = True
    args.account_for_loss_in_pipeline_split = True
    return True


PADDED_NOTE = (
    "--allow-padding-num-layers: the blocks holding the embedding and the loss get one layer fewer, built by "
    "Megatron-LM's own --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
)


def _uneven_foreign(placement: Placement, schedule: str, layers: list[int]) -> str:
    even = 2 * placement.num_stages
    return (
        f"--allow-padding-num-layers: Megatron-LM builds its TransformerConfig with --num-layers split evenly "
        f"over the {placement.num_stages} layer blocks before megatron-zb places them ({placement.kind} placement), "
        f"so {schedule} on Megatron-LM needs --num-layers divisible by {placement.num_stages} (e.g. {even}); uneven "
        f"blocks {layers} run with `megatron-zb train`, and on Megatron-LM with a schedule on its looping placement "
        "(e.g. --enable-zero-bubble)"
    )


def _blocks_text(placement: Placement) -> str:
    """Where the rank 0 chunks sit, e.g. 'rank 0 holds layer blocks 0 and 7'."""
    blocks = [str(placement.stage_of(0, placement.chunk_base + chunk)) for chunk in range(placement.chunks)]
    listed = ", ".join(blocks[:-1]) + " and " + blocks[-1] if len(blocks) > 1 else blocks[0]
    return f"rank 0 holds layer blocks {listed} of {placement.num_stages}"
