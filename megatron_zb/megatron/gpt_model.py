"""megatron-core GPTModel chunks for any placement, V included.

megatron-core assumes the looping placement in three places this module corrects for others:
which layers a chunk builds (``PlacementLayerLayout``), where the tied embedding copies live
(first and last pipeline rank; with V both are on rank 0), and which chunk's output
``Float16Module`` casts back to fp32 (the last rank's last chunk; with V the loss chunk is
rank 0's chunk 1). Linear and interleaved placements keep megatron's own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

from .. import patching
from ..schedule.placement import Placement
from .layout import PlacementLayerLayout
from .megatron_mapping import block_layers, uses_megatron_mapping


def embedding_chunk(placement: Placement, rank: int) -> int | None:
    """Index, in this rank's chunk list, of the chunk with the embedding (block 0); None elsewhere."""
    return _chunk_index(placement, rank, 0)


def loss_chunk(placement: Placement, rank: int) -> int | None:
    """Index, in this rank's chunk list, of the chunk with the output layer and loss; None elsewhere."""
    return _chunk_index(placement, rank, placement.num_stages - 1)


def _chunk_index(placement: Placement, rank: int, block: int) -> int | None:
    owner, chunk = placement.blocks[block]
    return chunk - placement.chunk_base if owner == rank else None


def embedding_ranks(placement: Placement) -> Callable[[list[int], int | None], list[int]]:
    """``get_embedding_ranks`` for ``initialize_model_parallel``: the ranks holding a word-embedding copy.

    For V that is rank 0 alone (a one-rank group: megatron's tied-gradient all-reduce is
    skipped and ``tied_embedding_finalize`` sums the two local copies instead).
    """
    return partial(_embedding_ranks, placement)


def _embedding_ranks(placement: Placement, pp_ranks: list[int], vp: int | None = None) -> list[int]:
    if len(pp_ranks) != placement.pp:
        raise ValueError(f"the {placement.kind} placement has {placement.pp} pipeline ranks, got {list(pp_ranks)}")
    holders = (placement.rank_of(0), placement.rank_of(placement.num_stages - 1))
    return list(dict.fromkeys(pp_ranks[rank] for rank in holders))


def build_gpt_chunks(
    config,
    placement: Placement,
    rank: int,
    *,
    vocab_size: int,
    max_sequence_length: int,
    layer_spec=None,
    share_embeddings_and_output_weights: bool = True,
    position_embedding_type: str = "learned_absolute",
    **gpt_kwargs,
) -> list:
    """This pipeline rank's GPTModel chunks, in chunk order.

    Needs megatron-core's parallel state initialised (with ``get_embedding_ranks=
    embedding_ranks(placement)`` when embeddings are tied). When
    ``config.pipeline_model_parallel_layout`` is unset and megatron's own mapping does not
    match ``placement``, it is set here, in place, to ``layer_layout(config.num_layers,
    placement)``; set it yourself (``pad=True``) for uneven blocks. ``layer_spec`` defaults to
    the local GPT layer spec; a callable is called with ``config`` (its layout set) and each
    chunk's ``vp_stage``: a block spec whose layers differ (MoE and dense layers mixed,
    ``block_spec_for``) is built per chunk from the layers that chunk holds.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _check_rank(placement, rank)
    use_placement_layout(config, placement)
    tied = share_embeddings_and_output_weights
    copies = tied or bool(getattr(config, "mtp_num_layers", None))  # MTP keeps an embedding copy with the loss
    if copies:
        _check_tied_placement(placement)
        _check_embedding_group(placement)
    spec = layer_spec if layer_spec is not None else get_gpt_layer_local_spec()
    last = placement.num_stages - 1
    chunks = []
    for index in range(placement.chunks):
        block = placement.stage_of(rank, placement.chunk_base + index)
        vp_stage = index if placement.chunks > 1 else None
        chunk_spec = _spec_for(spec, config, vp_stage)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=chunk_spec,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                pre_process=block == 0,
                post_process=block == last,
                share_embeddings_and_output_weights=tied,
                position_embedding_type=position_embedding_type,
                vp_stage=vp_stage,
                mtp_block_spec=mtp_block_spec(config, chunk_spec, vp_stage) if block == last else None,
                **gpt_kwargs,
            )
        )
    if copies:
        tie_local_copies(chunks, placement, rank)
    return chunks


def mtp_block_spec(config, chunk_spec, vp_stage: int | None):
    """megatron-core's multi-token prediction block for the loss chunk (None without ``mtp_num_layers``).

    Its layer is the chunk's last decoder layer (dense or MoE), as Megatron-LM's gpt_builders takes it;
    megatron-core finds the MTP layers in the layout (ours puts them in the last block) or, without
    one, on the last stage.
    """
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(chunk_spec, TransformerBlockSubmodules) and not chunk_spec.layer_specs:
        raise ValueError(
            "multi-token prediction takes its layer from the loss block's last decoder layer, and this loss block "
            "has none; give the last block decoder layers (no padding of the loss block)"
        )
    return get_gpt_mtp_block_spec(config, chunk_spec, use_transformer_engine=False, vp_stage=vp_stage)


def build_pipes(config, placements: tuple[Placement, ...], rank: int, shared=(), **kwargs) -> list:
    """This rank's chunks of every pipe, pipe by pipe (one placement: ``build_gpt_chunks``).

    Each pipe gets its own copy of ``config`` with its own layer layout (two pipes place the
    same layers differently). Of two copies of a block (``shared``, as ``Schedule.shared``) the
    later pipe's parameters are marked ``shared``: the gradient norm counts each weight once.
    """
    if len(placements) == 1:
        return build_gpt_chunks(config, placements[0], rank, **kwargs)
    import copy

    chunks = []
    for placement in placements:
        pipe_config = copy.copy(config)
        pipe_config.virtual_pipeline_model_parallel_size = placement.chunks if placement.chunks > 1 else None
        pipe_config.pipeline_model_parallel_layout = None
        chunks += build_gpt_chunks(pipe_config, placement, rank, **kwargs)
    mark_replicas(chunks, placements, rank, shared)
    return chunks


def mark_replicas(chunks: list, placements: tuple[Placement, ...], rank: int, shared=()) -> None:
    """Of two copies of a block (``shared``, as ``Schedule.shared``: pairs of (pipe, block)) the later pipe's
    parameters are marked ``shared``, as megatron marks a tied copy: the gradient norm counts each weight once.

    ``chunks`` is this rank's model list, each pipe's chunks after the pipes before it.
    """
    replicas, offset = {later for _, later in shared}, 0
    for pipe, placement in enumerate(placements):
        for index in range(placement.chunks):
            if (pipe, placement.stage_of(rank, placement.chunk_base + index)) in replicas:
                for param in chunks[offset + index].parameters():
                    param.shared = True
        offset += placement.chunks


def _spec_for(spec, config, vp_stage: int | None):
    """A spec, or a function of (config, vp_stage) returning one (block specs differ per chunk)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(spec, (ModuleSpec, TransformerBlockSubmodules)) or not callable(spec):
        return spec
    return spec(config, vp_stage)


def block_spec_for(normalization: str | None = None) -> Callable:
    """``layer_spec`` for ``build_gpt_chunks``: megatron-core's decoder block spec of each chunk (local, no TE).

    Each layer is dense or MoE as ``config.moe_layer_freq`` says of its global layer number, and
    the chunk's layers are the ones the config's layout (V, interleaved, BitPipe's pipes) gives it.
    """
    return partial(_block_spec, normalization)


def _block_spec(normalization: str | None, config, vp_stage: int | None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=normalization, vp_stage=vp_stage
    )


def _check_rank(placement: Placement, rank: int) -> None:
    from megatron.core import parallel_state

    if not 0 <= rank < placement.pp:
        raise ValueError(f"rank {rank} is outside the {placement.kind} placement's {placement.pp} pipeline ranks")
    if parallel_state.model_parallel_is_initialized():
        mine = parallel_state.get_pipeline_model_parallel_rank()
        if mine != rank:
            raise ValueError(
                f"building chunks for pipeline rank {rank} on pipeline rank {mine}: megatron-core numbers "
                "layers by its own pipeline rank; pass parallel_state.get_pipeline_model_parallel_rank()"
            )


def use_placement_layout(config, placement: Placement, pipes: tuple[Placement, ...] = ()) -> None:
    """Check the config against the placement; install a PlacementLayerLayout where megatron's mapping differs.

    ``pipes`` (``placement`` first): every pipe of one model list (BitPipe's two), whose chunks all count.
    """
    pipes = tuple(pipes) or (placement,)
    if config.pipeline_model_parallel_size != placement.pp:
        raise ValueError(
            f"pipeline_model_parallel_size is {config.pipeline_model_parallel_size} but the {placement.kind} "
            f"placement has {placement.pp} ranks; set --pipeline-model-parallel-size {placement.pp}"
        )
    virtual, chunks = config.virtual_pipeline_model_parallel_size, sum(pipe.chunks for pipe in pipes)
    if (virtual or 1) != chunks:
        wanted = chunks if chunks > 1 else None
        raise ValueError(
            f"virtual_pipeline_model_parallel_size is {virtual} but the {placement.kind} placement runs "
            f"{chunks} chunk(s) per rank; set it to {wanted}"
        )
    layout = config.pipeline_model_parallel_layout
    if isinstance(layout, PlacementLayerLayout):
        if layout.placements != pipes:
            raise ValueError(
                f"config.pipeline_model_parallel_layout was built for {layout!r}, not this {placement.kind} "
                f"placement (pp={placement.pp}, {len(pipes)} pipe(s))"
            )
        return
    if uses_megatron_mapping(placement):
        return  # megatron-core's own layer split (or the caller's megatron layout) is right as it is
    if layout is not None:
        raise ValueError(
            f"config.pipeline_model_parallel_layout {layout!r} assumes megatron's looping placement; the "
            f"{placement.kind} placement needs layer_layout(num_layers, placement) from megatron_zb.megatron.layout"
        )
    conflicts = [
        name
        for name in (
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        )
        if getattr(config, name, None)
    ]
    if conflicts:
        raise ValueError(
            f"the {placement.kind} placement splits layers with its own layout; unset {', '.join(conflicts)} "
            "(use layer_layout(..., pad=True) for lighter embedding and loss blocks)"
        )
    from .parsed_args import megatron_lm_args

    mtp = getattr(config, "mtp_num_layers", None)
    layers = block_layers(megatron_lm_args(), config.num_layers, placement)
    layout = PlacementLayerLayout(placement, layers, mtp or 0, pipes)
    layout.validate_layer_layout(config.num_layers, mtp)
    config.pipeline_model_parallel_layout = layout


def _check_tied_placement(placement: Placement) -> None:
    first, last = placement.blocks[0], placement.blocks[-1]
    same_rank = first[0] == last[0]
    megatron_ends = first == (0, placement.chunk_base) and last == (
        placement.pp - 1,
        placement.chunk_base + placement.chunks - 1,
    )
    if not (same_rank or megatron_ends):
        raise ValueError(
            f"tied embeddings need the embedding and the output layer on one rank (V) or on the first and the "
            f"last rank's outer chunks; the {placement.kind} placement puts them on {first} and {last} "
            "(rank, chunk): pass share_embeddings_and_output_weights=False (--untie-embeddings-and-output-weights)"
        )


def _check_embedding_group(placement: Placement) -> None:
    """megatron's default group pairs the first and the last rank: for V it must be rank 0 alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if placement.pp == 1 or not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    expected = sorted(_embedding_ranks(placement, pp_ranks))
    group = parallel_state.get_embedding_group(check_initialized=False)
    actual = sorted(dist.get_process_group_ranks(group)) if group is not None else None
    # both copies on one rank: fine while megatron's embedding all-reduce pairs this rank with no other
    local = len(expected) == 1 and (actual is None or len(actual) == 1)
    if not local and actual != (expected if dist.get_rank() in expected else None):
        raise ValueError(
            f"the embedding group is {actual} on rank {dist.get_rank()}, but the {placement.kind} placement "
            f"keeps the tied embedding copies on ranks {expected}: initialise megatron-core with "
            "initialize_model_parallel(..., get_embedding_ranks=embedding_ranks(placement))"
        )


def tie_local_copies(chunks: list, placement: Placement, rank: int) -> None:
    """Both copies on this rank (V): the output (or MTP) copy starts as the embedding, as megatron's all-reduce
    would do."""
    pair = _local_copies(chunks, placement, rank)
    if pair is None:
        return
    embedding, output = pair
    with torch.no_grad():
        output.copy_(embedding)
    embedding.shared_embedding = True  # DDP then gives each copy its own bucket (same distributed-optimizer shards)
    output.shared_embedding = True
    output.shared = True  # counted once in the gradient norm, as megatron counts the last stage's copy


def _local_copies(chunks: list, placement: Placement, rank: int) -> tuple | None:
    """(embedding weight, output weight) when this rank holds both in different chunks, else None."""
    first, last = embedding_chunk(placement, rank), loss_chunk(placement, rank)
    if first is None or last is None or first == last:
        return None
    embedding_model, output_model = unwrapped(chunks[first]), unwrapped(chunks[last])
    if getattr(output_model, "mtp_process", False):  # MTP's embedding copy (the output layer's too when tied)
        return embedding_model.embedding.word_embeddings.weight, output_model.embedding.word_embeddings.weight
    if not getattr(output_model, "share_embeddings_and_output_weights", False):
        return None
    return embedding_model.embedding.word_embeddings.weight, output_model.output_layer.weight


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def sum_tied_embedding_grads(model: list, placement: Placement, rank: int) -> None:
    """Give both local copies of a tied embedding the sum of their gradients (main_grad under DDP, else .grad)."""
    pair = _local_copies(model, placement, rank)
    if pair is None:
        return
    embedding, output = pair
    grads = [(param, _grad_attribute(param)) for param in pair]
    mine, theirs = (getattr(param, attribute) for param, attribute in grads)
    if mine is None and theirs is None:
        return
    with torch.no_grad():
        if mine is None:
            setattr(embedding, grads[0][1], theirs.clone())
        elif theirs is None:
            setattr(output, grads[1][1], mine.clone())
        else:
            mine.add_(theirs)
            theirs.copy_(mine)


def _grad_attribute(param: torch.nn.Parameter) -> str:
    return "main_grad" if getattr(param, "main_grad", None) is not None else "grad"


def tied_embedding_finalize(
    finalize_model_grads_func: Callable | None, placement: Placement | tuple[Placement, ...]
) -> Callable:
    """``finalize_model_grads_func`` that also sums the two tied-embedding copies a V rank holds.

    The sum runs after megatron's finalize: its data-parallel reduction has then finished
    (with ``overlap_grad_reduce`` it is in flight until then), and the rest of it (tensor-parallel
    sums, per-token scaling) is linear, so the order does not change the result. With the
    distributed optimizer each copy sits alone in its bucket, so both hold the same shard.
    """

    placements = placement if isinstance(placement, tuple) else (placement,)

    def finalize(model: list, num_tokens=None, *args, **kwargs) -> None:
        if finalize_model_grads_func is not None:
            finalize_model_grads_func(model, num_tokens, *args, **kwargs)
        rank, offset = pipeline_rank(kwargs.get("pg_collection")), 0
        for pipe in placements:  # each pipe's chunks follow the pipes before it in the model list
            sum_tied_embedding_grads(model[offset : offset + pipe.chunks], pipe, rank)
            offset += pipe.chunks

    return finalize


def pipeline_rank(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp.rank()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


class PlacementFloat16Module(Float16Module):
    """Float16Module that casts inputs on the embedding chunk and outputs on the loss chunk.

    megatron's decides by (first or last pipeline rank, first or last vp stage), which under V
    casts a hidden state on the last rank and leaves the loss chunk's output in half precision.
    """

    def __init__(self, config, module: torch.nn.Module, *, casts_input: bool, casts_output: bool):
        super().__init__(config, module)
        self.casts_input, self.casts_output = casts_input, casts_output

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        if self.casts_input:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if self.casts_output and fp32_output is True:
            outputs = float16_to_fp32(outputs)
        return outputs


def float16_chunks(config, chunks: list, placement: Placement, rank: int) -> list:
    """megatron-zb's own build: each chunk in a PlacementFloat16Module casting where ``placement`` needs it."""
    first, last = embedding_chunk(placement, rank), loss_chunk(placement, rank)
    return [
        PlacementFloat16Module(config, chunk, casts_input=index == first, casts_output=index == last)
        for index, chunk in enumerate(chunks)
    ]


def fix_float16_output_cast(wrapped_chunks: list, placement: Placement, rank: int) -> list:
    """Megatron-LM's build: the Float16Module inside each chunk (DDP may wrap it) becomes a PlacementFloat16Module.

    The class is swapped in place under the ``megatron-lm`` scope (Megatron-LM built the chunks; undone when its
    ``pretrain()`` returns). Chunks without a Float16Module (fp32 runs) are left alone. Returns ``wrapped_chunks``.
    """
    first, last = embedding_chunk(placement, rank), loss_chunk(placement, rank)
    for index, chunk in enumerate(wrapped_chunks):
        module = chunk
        while not isinstance(module, Float16Module) and hasattr(module, "module"):
            module = module.module
        if not isinstance(module, Float16Module):
            continue
        if type(module) not in (Float16Module, PlacementFloat16Module):
            raise TypeError(f"chunk {index} wraps a {type(module).__name__}; only megatron's Float16Module is fixed")
        patching.replace(module, "__class__", PlacementFloat16Module, patching.MEGATRON_LM)
        module.casts_input, module.casts_output = index == first, index == last
    return wrapped_chunks
