"""Megatron-LM's way of building and feeding model chunks, with install()'s hooks, gives the V its placement.

Two gloo ranks (pp=2) do what Megatron-LM does with real megatron-core: ``initialize_model_parallel``
with pretrain_gpt.py's embedding ranks (first and last), then ``get_model``'s loop, which builds
one GPTModel per virtual stage with pre/post process from megatron's looping predicates, then the
data and finalize helpers. Stand-ins for ``megatron.training.global_vars`` (the parsed arguments)
and ``megatron.training.utils`` reproduce Megatron-LM's code (megatron/training/utils.py,
core_v0.16.1 to main); tests/megatron/test_real_megatron_lm.py trains through the real checkouts.
"""

from __future__ import annotations

import argparse

import pytest

from megatron_zb.megatron.megatron_mapping import foreign_placement, prepare_args
from megatron_zb.schedule.placement import interleaved, linear, v_shape
from megatron_zb.testing.pool import WorkerPool

STAND_INS = ("megatron.training", "megatron.training.global_vars", "megatron.training.utils", "stand_in_pretrain_gpt")
UTILS = """
from megatron.core import parallel_state as mpu

def is_first_or_last_pipeline_stage(vp_stage):
    ignore_virtual = vp_stage is None
    return (mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            or mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage))

def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=False):
    return {"mtp_on_this_rank": mtp_on_this_rank}
"""


def megatron_args(flags: str) -> argparse.Namespace:
    """What Megatron-LM's validate_args leaves, then megatron-zb's check (pp=2, 4 layers, 4 microbatches)."""
    import megatron_zb
    from megatron_zb.megatron.args import schedule_settings

    args = megatron_zb.add_args(argparse.ArgumentParser()).parse_args(flags.split())
    args.pipeline_model_parallel_size, args.num_layers, args.virtual_pipeline_model_parallel_size = 2, 4, None
    args.micro_batch_size, args.global_batch_size, args.data_parallel_size, args.seed = 1, 4, 1, 1234
    settings = schedule_settings(args)
    prepare_args(args, settings.placement, settings.schedule, settings.placements)
    return args


def clean_up(saved: dict) -> None:
    """After a worker's stand-in modules: megatron-zb's patches undone, the groups destroyed, ``saved`` put back."""
    import sys

    import megatron_zb
    from megatron_zb.process_groups import destroy_model_parallel

    megatron_zb.uninstall()
    destroy_model_parallel()
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def test_only_placements_megatron_cannot_build_are_foreign() -> None:
    assert foreign_placement(v_shape(4)) == v_shape(4)
    assert foreign_placement(linear(4)) is None and foreign_placement(interleaved(4, 2)) is None
    assert foreign_placement(None) is None


def test_prepare_args_gives_v_two_chunks_and_leaves_megatrons_placements_alone() -> None:
    assert megatron_args("--zero-bubble-v-schedule").virtual_pipeline_model_parallel_size == 2
    assert megatron_args("--pipeline-schedule v-min").virtual_pipeline_model_parallel_size == 2
    assert megatron_args("--enable-zero-bubble").virtual_pipeline_model_parallel_size is None


def test_bitpipe_gets_both_pipes_chunks_in_one_model_list() -> None:
    """vp stage c is chunk id c: 0 and 1 the V's blocks, 2 and 3 its mirror's, the same layers on the other rank."""
    from megatron.core.transformer.enums import LayerType

    from megatron_zb.megatron.layout import PlacementLayerLayout
    from megatron_zb.megatron.placement_hooks import replica_chunks
    from megatron_zb.schedule.placement import mirrored

    args = megatron_args("--pipeline-schedule bitpipe-zb --zero-bubble-placement-independent-init")
    assert args.virtual_pipeline_model_parallel_size == 4
    pipes = (v_shape(2), mirrored(v_shape(2)))
    layout = PlacementLayerLayout(pipes[0], [1, 1, 1, 1], pipes=pipes)
    blocks = [[layout.block_of(vp, rank) for vp in range(4)] for rank in range(2)]
    assert blocks == [[0, 3, 1, 2], [1, 2, 0, 3]]
    offsets = [[layout.get_layer_offset(vp_stage=vp, pp_rank=rank) for vp in range(4)] for rank in range(2)]
    assert offsets == blocks  # one layer per block: the offset is the block
    assert layout.layout[1][2] == [LayerType.embedding, LayerType.decoder]  # the mirror's first block, on rank 1
    assert layout.layout[1][3] == [LayerType.decoder, LayerType.loss]
    assert layout.virtual_pipeline_model_parallel_size == 4
    shared = tuple(((0, block), (1, block)) for block in range(4))
    assert replica_chunks(pipes, 0, shared) == replica_chunks(pipes, 1, shared) == [2, 3]
    with pytest.raises(ValueError, match="the first pipe must be the layout's placement"):
        PlacementLayerLayout(pipes[0], [1, 1, 1, 1], pipes=pipes[::-1])
    with pytest.raises(ValueError, match="on consecutive chunk ids"):
        PlacementLayerLayout(pipes[0], [1, 1, 1, 1], pipes=(pipes[0], pipes[0]))


def test_bitpipe_without_the_same_init_is_refused() -> None:
    """Megatron-LM draws each rank's weights from its own seed: the two copies of a block would differ."""
    from megatron_zb.megatron_lm.validation import check_zero_bubble

    args = megatron_args("--pipeline-schedule bitpipe-zb")
    with pytest.raises(ValueError, match="add --zero-bubble-placement-independent-init"):
        check_zero_bubble(args)
    args.zero_bubble_placement_independent_init = True
    assert check_zero_bubble(args) == [] and args.virtual_pipeline_model_parallel_size == 4


def test_prepare_args_refuses_megatrons_layout_flags_and_uneven_v_blocks() -> None:
    args = megatron_args("--enable-zero-bubble")
    args.decoder_first_pipeline_num_layers, args.account_for_loss_in_pipeline_split = 1, True
    args.pipeline_model_parallel_layout = "E|t|t|tL"
    with pytest.raises(ValueError) as refused:
        prepare_args(args, v_shape(2), "zb-v")
    assert str(refused.value) == (
        "zb-v places its layer blocks itself (v placement: rank 0 holds layer blocks 0 and 3 of 4); "
        "--pipeline-model-parallel-layout, --account-for-loss-in-pipeline-split lay layers out by megatron's "
        "looping placement (block = virtual stage x pipeline size + rank): drop them"
    )
    uneven = megatron_args("--enable-zero-bubble")
    uneven.num_layers, uneven.allow_padding_num_layers = 6, True
    with pytest.raises(
        ValueError, match=r"needs --num-layers divisible by 4 \(e\.g\. 8\); uneven blocks \[1, 2, 2, 1\]"
    ):
        prepare_args(uneven, v_shape(2), "zb-v")


@pytest.mark.parametrize(
    "first, last, layers", [(1, None, (1, 2, 2, 2)), (None, 1, (2, 2, 2, 1)), (3, 2, (3, 1, 1, 2))]
)
def test_first_and_last_stage_counts_are_the_v_blocks_ends(first, last, layers) -> None:
    """--decoder-first/last-pipeline-num-layers on a V: the first and the last layer block (both on rank 0) take
    them, the blocks between split the rest; megatron-core's config is left without them (it would split by its
    looping placement), the counts kept for the placement's layout."""
    from megatron_zb.megatron.megatron_mapping import block_layers

    args = megatron_args("--enable-zero-bubble")
    args.num_layers, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = 7, first, last
    prepare_args(args, v_shape(2), "zb-v")
    assert args.zero_bubble_block_layers == layers and args.virtual_pipeline_model_parallel_size == 2
    assert args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None
    assert block_layers(args, 7, v_shape(2)) == list(layers) and block_layers(None, 8, v_shape(2)) == [2, 2, 2, 2]


def test_first_and_last_counts_that_leave_an_uneven_middle_are_refused() -> None:
    args = megatron_args("--enable-zero-bubble")
    args.num_layers, args.decoder_first_pipeline_num_layers = 7, 2
    with pytest.raises(ValueError, match="--decoder-first-pipeline-num-layers 2 leave 5 of --num-layers 7 to the 3 "
                       "other layer blocks of 4"):  # fmt: skip
        prepare_args(args, v_shape(2), "zb-v")


def build_like_megatron_lm(flags: str, tied: bool = True) -> dict:
    """One rank of pp=2: Megatron-LM's initialize, get_model loop, data and finalize helpers, hooks installed."""
    import sys
    import types

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )

    import megatron_zb
    from megatron_zb.megatron.placement_hooks import prepare_chunks, tied_finalize
    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    saved = {name: sys.modules.get(name) for name in STAND_INS}
    try:
        args = megatron_args(flags)
        for name in STAND_INS:
            sys.modules[name] = types.ModuleType(name)
        sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS = args
        exec(UTILS, sys.modules["megatron.training.utils"].__dict__)
        script = sys.modules["stand_in_pretrain_gpt"]  # pretrain_gpt.py binds both by name at import
        exec(
            "from megatron.training.utils import is_first_or_last_pipeline_stage, get_batch_on_this_tp_rank",
            script.__dict__,
        )
        megatron_zb.install()
        destroy_model_parallel()
        vp = args.virtual_pipeline_model_parallel_size
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=vp,
            get_embedding_ranks=lambda pp_ranks, *rest: [pp_ranks[0], pp_ranks[-1]],  # pretrain_gpt.py's, tied
        )
        group = parallel_state.get_embedding_group(check_initialized=False)
        embedding_group = dist.get_process_group_ranks(group) if group is not None else None
        toy = ToyGPT(layers=4)
        config = toy.config(2, vp or 1)
        pp_group, chunks = parallel_state.get_pipeline_model_parallel_group(), []
        for stage in range(vp or 1):  # megatron/training/training.py get_model()
            vp_stage = stage if vp else None
            chunks.append(
                GPTModel(
                    config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=toy.vocab,
                    max_sequence_length=toy.seq,
                    pre_process=is_pp_first_stage(pp_group) and is_vp_first_stage(stage, vp),
                    post_process=is_pp_last_stage(pp_group) and is_vp_last_stage(stage, vp),
                    share_embeddings_and_output_weights=tied,
                    vp_stage=vp_stage,
                )
            )
        found = {
            "ends": [[chunk.pre_process, chunk.post_process] for chunk in chunks],
            "layer_numbers": [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks],
            "embedding_group": embedding_group,
            "reads_data": [script.is_first_or_last_pipeline_stage(stage if vp else None) for stage in range(vp or 1)],
            "tp_batch": script.get_batch_on_this_tp_rank(None, mtp_on_this_rank=False),
        }
        copies = [chunk.shared_embedding_or_output_weight() for chunk in chunks]
        found["output_copy_zero_before"] = [bool(w is not None and not w.any()) for w in copies]
        prepare_chunks(chunks)
        found["copies_equal_after"] = (
            len(copies) == 2 and all(w is not None for w in copies) and bool(torch.equal(copies[0], copies[1]))
        )
        for weight, value in zip(copies, (1.0, 2.0), strict=False):
            if weight is not None:
                weight.grad = torch.full_like(weight, value)
        tied_finalize(lambda model, num_tokens=None, **kwargs: None)(chunks)
        found["grads_after_finalize"] = [None if w is None else float(w.grad.mean()) for w in copies]
        return found
    finally:
        clean_up(saved)


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


def test_v_chunks_data_and_tied_copies_follow_the_placement(pool: WorkerPool) -> None:
    rank0, rank1 = pool.run(build_like_megatron_lm, flags="--zero-bubble-v-schedule")
    # rank 0 holds blocks 0 (embedding) and 3 (output layer, loss); rank 1 blocks 1 and 2
    assert rank0["ends"] == [[True, False], [False, True]] and rank1["ends"] == [[False, False], [False, False]]
    assert rank0["layer_numbers"] == [[1], [4]] and rank1["layer_numbers"] == [[2], [3]]
    assert rank0["embedding_group"] == [0] and rank1["embedding_group"] is None
    assert rank0["reads_data"] == [True, True] and rank1["reads_data"] == [False, False]
    assert rank0["tp_batch"] == rank1["tp_batch"] == {"mtp_on_this_rank": True}
    # megatron fills the output copy with 0 and all-reduces it with the embedding over the (one-rank) group
    assert rank0["output_copy_zero_before"] == [False, True] and rank0["copies_equal_after"]
    assert rank0["grads_after_finalize"] == [3.0, 3.0] and rank1["grads_after_finalize"] == [None, None]


def test_megatrons_own_placement_is_left_to_megatron(pool: WorkerPool) -> None:
    rank0, rank1 = pool.run(build_like_megatron_lm, flags="--enable-zero-bubble")
    assert rank0["ends"] == [[True, False]] and rank1["ends"] == [[False, True]]
    assert rank0["layer_numbers"] == [[1, 2]] and rank1["layer_numbers"] == [[3, 4]]
    assert rank0["embedding_group"] == rank1["embedding_group"] == [0, 1]
    assert rank0["reads_data"] == rank1["reads_data"] == [True]
    assert rank0["tp_batch"] == {"mtp_on_this_rank": False}
    assert rank1["output_copy_zero_before"] == [False]  # the init all-reduce copied rank 0's embedding
    assert rank0["grads_after_finalize"] == [1.0] and rank1["grads_after_finalize"] == [1.0]


# Megatron-LM's gpt_builder (gpt_builders.py, pretrain_gpt's model provider in core_v0.16.1) builds each chunk's config
# from its arguments and the MoE-or-dense block spec from that config before the GPTModel; the stand-in arguments
# module copies the arguments' TransformerConfig fields as Megatron-LM's core_transformer_config_from_args does.
ARGUMENTS = """
import dataclasses

import torch
from megatron.core.transformer import TransformerConfig

SIZES = dict(
    hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    add_bias_linear=False, num_moe_experts=2, moe_ffn_hidden_size=8, moe_router_topk=2,
    moe_token_dispatcher_type="allgather", pipeline_dtype=torch.float32,
)

def core_transformer_config_from_args(args):
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(TransformerConfig)
             if hasattr(args, field.name)}
    return TransformerConfig(**SIZES, **given)
"""


def layer_kinds_like_megatron_lm(flags: str, moe_layer_freq: list[int]) -> dict:
    """One rank of pp=2: each chunk's (layer number, "moe" or "dense"), built as Megatron-LM's gpt_builder builds
    it (config from the arguments, then get_gpt_decoder_block_spec for the chunk's vp stage), hooks installed."""
    import sys
    import types

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_zb
    from megatron_zb.process_groups import destroy_model_parallel

    names = ("megatron.training", "megatron.training.global_vars", "megatron.training.arguments")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        args = megatron_args(flags)
        args.moe_layer_freq, args.pipeline_model_parallel_layout = moe_layer_freq, None  # Megatron-LM's default
        for name in names:
            sys.modules[name] = types.ModuleType(name)
        sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS = args
        arguments = sys.modules["megatron.training.arguments"]
        exec(ARGUMENTS, arguments.__dict__)
        megatron_zb.install()
        destroy_model_parallel()
        vp = args.virtual_pipeline_model_parallel_size
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp
        )
        kinds = []
        for stage in range(vp or 1):  # get_model()'s loop, then gpt_builder for the chunk
            vp_stage = stage if vp else None
            config = arguments.core_transformer_config_from_args(args)
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
            chunk = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=8,
                             share_embeddings_and_output_weights=False, vp_stage=vp_stage)  # fmt: skip
            kinds.append(
                [
                    (layer.layer_number, "moe" if isinstance(layer.mlp, MoELayer) else "dense")
                    for layer in chunk.decoder.layers
                ]  # fmt: skip
            )
        return {"kinds": kinds, "layout_restored": args.pipeline_model_parallel_layout is None}
    finally:
        clean_up(saved)


@pytest.mark.parametrize(
    "flags, expected",
    [
        # the V: rank 0 holds layers 1 and 4, rank 1 layers 2 and 3 (megatron's looping mapping would give rank 0's
        # vp 1 layer 3's spec)
        ("--zero-bubble-v-schedule", [[[(1, "dense")], [(4, "moe")]], [[(2, "moe")], [(3, "dense")]]]),
        # megatron's own placement: left to megatron's split
        ("--enable-zero-bubble", [[[(1, "dense"), (2, "moe")]], [[(3, "dense"), (4, "moe")]]]),
    ],
)
def test_each_layer_is_moe_or_dense_as_its_number_says(pool: WorkerPool, flags: str, expected: list) -> None:
    """--moe-layer-freq [0,1,0,1] (layers 2 and 4 MoE): Megatron-LM's model provider builds every chunk's layer
    specs from the config, so the config carries the placement's layout from the start."""
    results = pool.run(layer_kinds_like_megatron_lm, flags=flags, moe_layer_freq=[0, 1, 0, 1])
    assert [result["kinds"] for result in results] == expected
    assert all(result["layout_restored"] for result in results)
