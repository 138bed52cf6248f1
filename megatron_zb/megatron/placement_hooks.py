"""Megatron-LM's own training loop on a placement that megatron does not build itself (the V).

Megatron-LM decides with ``is_pipeline_first_stage``/``is_pipeline_last_stage`` and the
(pp stage, vp stage) predicates which chunk gets the embedding and the loss, which chunks load
data and which ranks hold the tied embedding copies. All of it assumes megatron's looping
placement (block ``vp * pp + rank``). When the schedule's placement maps blocks otherwise (V:
rank r holds blocks r and 2p-1-r, embedding and loss both on rank 0), these hooks give
Megatron-LM's code the placement's answers:

- ``megatron_mapping.prepare_args`` (after ``validate_args``): one model chunk per (rank, chunk) of the placement
  (``virtual_pipeline_model_parallel_size``; BitPipe: of both pipes); megatron's own layout flags are refused.
- ``core_transformer_config_from_args``: the config is built with the placement's layer layout
  (``PlacementLayerLayout``; BitPipe: both pipes'), so the layer specs Megatron-LM's model provider builds before
  the GPTModel (MoE or dense per ``--moe-layer-freq``; any spec megatron-core slices by the config's layout) are
  those of the layers each chunk holds, not megatron's looping mapping's (V, pp 2: rank 0's vp 1 holds layer 4,
  not 3), and megatron-core's check does not split --num-layers over BitPipe's 2 x 2 chunks per rank. With MTP
  under the V megatron-core then marks the config ``mtp_standalone`` (MTP on a rank other than the last); only its
  own P2P reads it (to exchange shapes), which these schedules do not use.
- ``GPTModel.__init__``: the chunk's config gets the placement's layer layout (``PlacementLayerLayout``, in
  place, where a config was built without it) and pre/post process follow its block.
- ``initialize_model_parallel``: the embedding group holds the ranks with a word-embedding copy
  (V: rank 0 alone, so megatron's tied-gradient all-reduce is skipped).
- ``is_first_or_last_pipeline_stage(vp_stage)``: the chunks holding the first or the last block
  load data (V: both chunks of rank 0).
- ``get_batch_on_this_tp_rank``: every tensor is broadcast over the tensor-parallel ranks (the
  pipeline-first rule would drop the labels that rank 0's loss chunk needs).
- ``mtp_on_this_rank`` and ``get_mtp_num_layers_to_build`` (multi-token prediction): the chunk with the
  last block builds the MTP layers (the chunk's layout says so once set; pretrain_gpt and gpt_builders
  ask with a fresh config that has none).
- ``MTPLossLoggingHelper.track_mtp_metrics``: the MTP losses, tracked where the loss chunk runs (V:
  rank 0), are summed over the pipeline first, so that the last rank, which logs, has them.
- ``prepare_chunks`` (before the optimizer is built): the output copy of a tied embedding starts
  as the embedding, and ``Float16Module`` casts on the embedding and the loss chunk.
- ``finalize_model_grads`` (Megatron-LM's): the two local copies' gradients are summed.

A schedule of two pipes (BitPipe) gets one model list: vp stage ``c`` is chunk id ``c`` of the pipe that
owns it (``layout.pipe_of``), each block is built twice, the later pipe's copy is marked ``shared`` (counted once
in the gradient norm), and the runtime sums the copies' gradients (REPLICA_SYNC). The runtime already ships the
loss dicts to the last pipeline rank (which logs) and sums the token count over the pipeline. Each hook is
recorded in ``patching`` and calls Megatron's own function unless Megatron-LM's arguments select such a
placement or the chunk carries its layout.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator

from .. import patching
from ..schedule.placement import Placement
from .megatron_mapping import foreign_placement
from .parsed_args import megatron_lm_args, megatron_lm_settings


def install() -> None:
    """Hook megatron-core's GPTModel and initialize_model_parallel, and Megatron-LM's data helpers when loaded."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    patching.hook(GPTModel, "__init__", _gpt_model_init)
    patching.hook(parallel_state, "initialize_model_parallel", _initialize_model_parallel)
    from megatron.core.transformer import multi_token_prediction

    patching.hook(multi_token_prediction, "mtp_on_this_rank", _mtp_stage, everywhere=True)
    patching.hook(multi_token_prediction, "get_mtp_num_layers_to_build", _mtp_layers, everywhere=True)
    patching.hook(multi_token_prediction.MTPLossLoggingHelper, "track_mtp_metrics", _mtp_metrics)
    if "megatron.training" not in sys.modules:
        return
    arguments = sys.modules.get("megatron.training.arguments")
    if arguments is not None:
        patching.hook(arguments, "core_transformer_config_from_args", _config_from_args, everywhere=True)
    owners = [sys.modules.get("megatron.training.utils"), sys.modules.get("megatron.core.utils")]
    for owner in [owner for owner in owners if owner is not None]:
        patching.hook(owner, "is_first_or_last_pipeline_stage", _data_stage, everywhere=True)
        patching.hook(owner, "get_batch_on_this_tp_rank", _tp_batch, everywhere=True)


def active_placement() -> Placement | None:
    """The placement Megatron-LM's arguments select, when megatron cannot build it itself."""
    settings = megatron_lm_settings()
    return foreign_placement(settings.placement if settings is not None else None)


def active_pipes() -> tuple[Placement, ...] | None:
    """Every pipe's placement Megatron-LM's arguments select (BitPipe: two), when megatron cannot build them."""
    settings = megatron_lm_settings()
    if settings is None or foreign_placement(settings.placement) is None:
        return None
    return settings.placements


def chunks_pipes(chunks: list) -> tuple[Placement, ...] | None:
    """Every pipe's foreign placement the chunks were built for (their config's PlacementLayerLayout), else None."""
    from .layout import PlacementLayerLayout

    if not chunks:
        return None
    layout = getattr(_config_of(chunks[0]), "pipeline_model_parallel_layout", None)
    if not isinstance(layout, PlacementLayerLayout) or foreign_placement(layout.placement) is None:
        return None
    return layout.placements


def pipe_slices(pipes: tuple[Placement, ...]) -> list[tuple[Placement, slice]]:
    """Each pipe with the slice of a rank's model list that holds its chunks (the pipes' chunks follow each other)."""
    found, offset = [], 0
    for pipe in pipes:
        found.append((pipe, slice(offset, offset + pipe.chunks)))
        offset += pipe.chunks
    return found


def block_of(pipes: tuple[Placement, ...], rank: int, vp_stage: int) -> int:
    """The layer block, in its pipe, that vp stage ``vp_stage`` of pipeline rank ``rank`` holds."""
    from .layout import pipe_of

    return pipe_of(pipes, vp_stage).stage_of(rank, pipes[0].chunk_base + vp_stage)


@contextlib.contextmanager
def placement_layout_in(args) -> Iterator[None]:
    """Megatron-LM's ``args`` carry the placement's layer layout while a TransformerConfig is built from them.

    Only for a placement megatron does not build itself (the V; BitPipe's pipes): the per-layer specs built from
    the config then follow the placement's layers; ``args`` are restored after. Preflight builds its config under
    it too.
    """
    layout = _args_layout(args)
    if layout is None:
        yield
        return
    given = args.pipeline_model_parallel_layout
    args.pipeline_model_parallel_layout = layout
    try:
        yield
    finally:
        args.pipeline_model_parallel_layout = given


def _args_layout(args):
    """The PlacementLayerLayout Megatron-LM's (validated) ``args`` select, or None."""
    import copy

    from .args import schedule_settings
    from .layout import PlacementLayerLayout
    from .megatron_mapping import block_layers

    if not hasattr(args, "enable_zero_bubble") or getattr(args, "pipeline_model_parallel_layout", None) is not None:
        return None
    settings = megatron_lm_settings() if args is megatron_lm_args() else schedule_settings(copy.copy(args))
    if settings is None or foreign_placement(settings.placement) is None:
        return None
    placement, mtp = settings.placement, getattr(args, "mtp_num_layers", None) or 0
    return PlacementLayerLayout(placement, block_layers(args, args.num_layers, placement), mtp, settings.placements)


def _config_from_args(original: Callable) -> Callable:
    @functools.wraps(original)
    def core_transformer_config_from_args(args, *rest, **kwargs):
        with placement_layout_in(args):
            return original(args, *rest, **kwargs)

    return core_transformer_config_from_args


def _config_of(chunk):
    while not hasattr(chunk, "config") and hasattr(chunk, "module"):
        chunk = chunk.module
    return getattr(chunk, "config", None)


def _gpt_model_init(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        ends = _chunk_ends(bound.arguments)
        if ends is not None:
            bound.arguments["pre_process"], bound.arguments["post_process"] = ends
        result = original(*bound.args, **bound.kwargs)
        if ends is not None:
            _mark_embedding_copy(bound.arguments["self"])
        return result

    return __init__


def _mark_embedding_copy(model) -> None:
    """The word embedding of an embedding chunk whose tied copy sits on the same rank gets its own DDP bucket.

    megatron marks it ``shared_embedding`` only on the first rank's first vp stage; BitPipe's mirrored pipe has its
    embedding on the last rank. Without its own bucket the distributed optimizer shards it otherwise than its copy,
    and the sum of the two local copies' gradients (``tied_finalize``) would add mismatched shards. Set at build,
    before ``get_model`` wraps the chunk in DDP.
    """
    config = getattr(model, "config", None)
    copies = getattr(model, "share_embeddings_and_output_weights", False) or getattr(config, "mtp_num_layers", None)
    if getattr(model, "pre_process", False) and not getattr(model, "post_process", False) and copies:
        model.embedding.word_embeddings.weight.shared_embedding = True


def _chunk_ends(arguments: dict) -> tuple[bool, bool] | None:
    """(pre_process, post_process) of the chunk being built, from its block; None to keep megatron's."""
    from .gpt_model import pipeline_rank, use_placement_layout
    from .layout import PlacementLayerLayout

    config, vp_stage = arguments.get("config"), arguments.get("vp_stage")
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    pipes = layout.placements if isinstance(layout, PlacementLayerLayout) else active_pipes()
    if pipes is None or foreign_placement(pipes[0]) is None or vp_stage is None:
        return None
    use_placement_layout(config, pipes[0], pipes)  # sets the layout in place, or checks the one set
    block = block_of(pipes, pipeline_rank(arguments.get("pg_collection")), vp_stage)
    return block == 0, block == pipes[0].num_stages - 1


def _initialize_model_parallel(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        from .gpt_model import embedding_ranks

        placement = active_placement()
        if placement is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.arguments["get_embedding_ranks"] = embedding_ranks(placement)
        return original(*bound.args, **bound.kwargs)

    return initialize_model_parallel


def _data_stage(original: Callable) -> Callable:
    @functools.wraps(original)
    def is_first_or_last_pipeline_stage(vp_stage, *args, **kwargs):
        from .gpt_model import pipeline_rank

        pipes = active_pipes()
        if pipes is None or vp_stage is None:
            return original(vp_stage, *args, **kwargs)
        return block_of(pipes, pipeline_rank(None), vp_stage) in (0, pipes[0].num_stages - 1)

    return is_first_or_last_pipeline_stage


def _mtp_stage(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def mtp_on_this_rank(*args, **kwargs):
        from .gpt_model import pipeline_rank

        pipes = active_pipes()
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        vp_stage = arguments.get("vp_stage")
        if pipes is None or vp_stage is None or arguments.get("ignore_virtual", True):
            return original(*bound.args, **bound.kwargs)
        config = arguments.get("config")  # megatron-core 0.16; 0.19 passes mtp_num_layers itself
        layers = getattr(config, "mtp_num_layers", None) if config is not None else arguments.get("mtp_num_layers")
        return bool(layers) and _last_block(pipes, vp_stage, pipeline_rank(None))

    return mtp_on_this_rank


def _mtp_layers(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_mtp_num_layers_to_build(*args, **kwargs):
        from .layout import PlacementLayerLayout

        pipes = active_pipes()
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        config, vp_stage = bound.arguments["config"], bound.arguments.get("vp_stage")
        own = isinstance(getattr(config, "pipeline_model_parallel_layout", None), PlacementLayerLayout)
        if pipes is None or vp_stage is None or own:
            return original(*bound.args, **bound.kwargs)
        rank = bound.arguments.get("pp_rank")
        if rank is None:
            from .gpt_model import pipeline_rank

            rank = pipeline_rank(None)
        return (config.mtp_num_layers or 0) if _last_block(pipes, vp_stage, rank) else 0

    return get_mtp_num_layers_to_build


def _last_block(pipes: tuple[Placement, ...], vp_stage: int, rank: int) -> bool:
    return block_of(pipes, rank, vp_stage) == pipes[0].num_stages - 1


_last_mtp_losses: list[float] = []


def _mtp_metrics(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def track_mtp_metrics(*args, **kwargs):
        placement = active_placement()
        if placement is not None and placement.rank_of(placement.num_stages - 1) != placement.pp - 1:
            gather_mtp_tracker(megatron_lm_args().mtp_num_layers)
        bound = signature.bind(*args, **kwargs)
        total = bound.arguments.get("total_loss_dict")
        bound.arguments["total_loss_dict"] = mine = {}  # this iteration's alone, added to Megatron-LM's below
        result = original(*bound.args, **bound.kwargs)
        for name, loss in mine.items():
            if total is not None:
                total[name] = total[name] + loss if name in total else loss
        _last_mtp_losses[:] = [float(loss) for name, loss in mine.items() if name.endswith(" loss")]  # layer order
        return result

    return track_mtp_metrics


def last_mtp_losses() -> list[float] | None:
    """The MTP losses (one per layer) Megatron-LM's training_log logged last, None before any."""
    return list(_last_mtp_losses) or None


def gather_mtp_tracker(layers: int) -> None:
    """Sum megatron-core's MTP tracker over the pipeline ranks (every rank calls it; only one holds values)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from ..process_groups import group_device

    tracker = MTPLossLoggingHelper.tracker
    group = parallel_state.get_pipeline_model_parallel_group()
    metrics = hasattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker")  # 0.19: losses, correct and total counts
    for key in ("loss_values", "correct_values", "total_values") if metrics else ("values",):
        if key not in tracker:
            tracker[key] = torch.zeros(layers, device=group_device(group))
        dist.all_reduce(tracker[key], group=group)
    if tracker.get("avg_group") is None:  # the loss chunk's rank averages over data parallelism: so does this one
        tracker["avg_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)


def _tp_batch(original: Callable) -> Callable:
    signature = inspect.signature(original)
    takes_mtp = "mtp_on_this_rank" in signature.parameters

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args, **kwargs):
        if active_placement() is None:
            return original(*args, **kwargs)
        if not takes_mtp:
            raise NotImplementedError(
                "this Megatron-LM's get_batch_on_this_tp_rank has no mtp_on_this_rank argument, through which "
                "megatron-zb broadcasts the whole batch to every tensor-parallel rank of a chunk that needs both "
                "tokens and labels; run this placement with --tensor-model-parallel-size 1 or `megatron-zb train`"
            )
        bound = signature.bind(*args, **kwargs)
        bound.arguments["mtp_on_this_rank"] = True  # the branch that broadcasts every tensor
        return original(*bound.args, **bound.kwargs)

    return get_batch_on_this_tp_rank


def prepare_chunks(chunks: list) -> None:
    """Before Megatron-LM builds the optimizer: what its model building leaves undone for the placement.

    With ``--zero-bubble-placement-independent-init`` every parameter is first re-drawn from
    (``--seed``, its name in the unpipelined model), whatever the placement and schedule; with
    ``--zero-bubble-order-independent-dropout`` the dropout masks are keyed likewise (``dropout_keys``).
    """
    args = megatron_lm_args()
    if chunks and args is not None and getattr(args, "zero_bubble_placement_independent_init", False):
        from .init import placement_independent_init

        placement_independent_init(chunks, _config_of(chunks[0]), args.seed)
    if chunks and args is not None and getattr(args, "zero_bubble_order_independent_dropout", False):
        from .dropout_keys import install

        install(chunks, args.seed)
    pipes = chunks_pipes(chunks)
    if pipes is None:
        return
    from .gpt_model import fix_float16_output_cast, mark_replicas, pipeline_rank, tie_local_copies

    rank = pipeline_rank(None)
    for pipe, part in pipe_slices(pipes):
        tie_local_copies(chunks[part], pipe, rank)  # megatron's init all-reduce has no second rank to copy from
        fix_float16_output_cast(chunks[part], pipe, rank)
    if len(pipes) > 1:
        shared = megatron_lm_settings().shared
        mark_replicas(chunks, pipes, rank, shared)
        for index in replica_chunks(pipes, rank, shared):
            _checkpoint_as_replica(chunks[index])


def replica_chunks(pipes: tuple[Placement, ...], rank: int, shared) -> list[int]:
    """This rank's chunks (model-list indices) that hold the later copy of a block kept twice (``shared``)."""
    replicas = {later for _, later in shared}
    return [
        offset
        for pipe_index, (pipe, part) in enumerate(pipe_slices(pipes))
        for offset in range(part.start, part.stop)
        if (pipe_index, pipe.stage_of(rank, pipe.chunk_base + offset - part.start)) in replicas
    ]


def _checkpoint_as_replica(chunk) -> None:
    """The chunk's sharded state dict marks every entry a replica: the block's first copy, on its own rank, is the
    one megatron-core saves under those keys (two main replicas of one key are refused), and loading fills both.

    Recorded under the ``megatron-lm`` scope (Megatron-LM built the chunk; undone when its ``pretrain()`` returns).
    """
    from .gpt_model import unwrapped

    model = unwrapped(chunk)  # Megatron-LM's checkpointing unwraps DDP and Float16Module; both delegate to it
    original = model.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        found = original(*args, **kwargs)
        for entry in nested_values(found):
            replica = getattr(entry, "replica_id", None)
            if replica is not None:
                entry.replica_id = replica + 1 if isinstance(replica, int) else (replica[0] + 1, *replica[1:])
        return found

    patching.replace(model, "sharded_state_dict", sharded_state_dict, patching.MEGATRON_LM)


def tied_finalize(original: Callable) -> Callable:
    """Megatron-LM's ``finalize_model_grads``, then the sum of the tied copies one rank holds."""

    @functools.wraps(original)
    def finalize_model_grads(model, num_tokens=None, *args, **kwargs):
        from .gpt_model import pipeline_rank, sum_tied_embedding_grads

        result = original(model, num_tokens, *args, **kwargs)
        pipes = chunks_pipes(list(model))
        for pipe, part in pipe_slices(pipes or ()):
            sum_tied_embedding_grads(list(model)[part], pipe, pipeline_rank(kwargs.get("pg_collection")))
        return result

    return finalize_model_grads
