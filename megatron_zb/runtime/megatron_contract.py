"""megatron-core's side of ``forward_backward_func``: what it hands us, and what it expects back.

megatron-core calls the schedule with its own conventions: one data iterator per model chunk,
process groups from ``pg_collection`` or ``parallel_state``, one boundary tensor shape per
stage, gradient sync under ``no_sync`` until ``finalize_model_grads``, the loss dicts on the last
pipeline rank. They are kept here, apart from the schedule and its execution, so that a change
of megatron-core's contract touches one file; so are the settings this runtime refuses.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compat import encoder_and_decoder_model_type, require_supported_megatron_core
from ..schedule import Schedule

require_supported_megatron_core()  # before anything here touches megatron-core: a clear refusal, not an AttributeError

# A post-validated optimizer (megatron_zb.optimizer.PostValidation) sets itself on the model config
# under this name; the runtime then checks its pending step where the schedule's speculation says.
CONFIG_ATTRIBUTE = "megatron_zb_post_validation"


@dataclass(frozen=True)
class Groups:
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    cp_size: int


def process_groups(pg_collection) -> Groups:
    """The pipeline and tensor groups of this call: ``pg_collection``'s (0.19+) or ``parallel_state``'s."""
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        cp = getattr(pg_collection, "cp", None)
        return Groups(pg_collection.pp, pg_collection.tp, cp.size() if cp is not None else 1)
    from megatron.core import parallel_state

    return Groups(
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_context_parallel_world_size(),
    )


def per_chunk_iterators(data_iterator, chunks: int) -> list:
    """One data iterator per model chunk, as Megatron builds them for virtual pipelines."""
    if isinstance(data_iterator, list):
        if len(data_iterator) != chunks:
            raise ValueError(f"got {len(data_iterator)} data iterators for {chunks} model chunks; give one per chunk")
        return data_iterator
    if chunks > 1:
        raise ValueError(
            f"{chunks} model chunks need a list of {chunks} data iterators (one per chunk, as Megatron builds "
            f"them for virtual pipelines); got a single iterator"
        )
    return [data_iterator]


def model_config(model: torch.nn.Module):
    from megatron.core.utils import get_model_config

    return get_model_config(model)


def refuse_unsupported(config, model: torch.nn.Module | None = None) -> None:
    """Settings this runtime does not run yet, refused before the first pass."""
    encoder_and_decoder = encoder_and_decoder_model_type()  # None on 0.16 (a property) and from 0.17 (gone)
    if model is not None and encoder_and_decoder is not None:
        from megatron.core.utils import get_model_type

        if get_model_type(model) == encoder_and_decoder:
            raise ValueError("megatron-zb schedules run decoder-only models (one boundary tensor per stage)")
    refused = {
        "variable_seq_lengths": "variable sequence lengths between microbatches",
        "defer_embedding_wgrad_compute": "--defer-embedding-wgrad-compute (zero bubble already defers W)",
    }
    for name, what in refused.items():
        if getattr(config, name, False):
            raise ValueError(f"megatron-zb schedules do not support {what}; turn {name} off")
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise ValueError(
            "megatron-zb schedules do not support --num-microbatches-with-partial-activation-checkpoints; "
            "use full or selective recompute instead"
        )


def boundary_shape(config, seq_length: int, micro_batch_size: int, groups: Groups, adjust) -> tuple[int, ...]:
    """The boundary tensor between stages: [sequence, microbatch, hidden] after CP/SP splits."""
    seq = seq_length // groups.cp_size
    if config.sequence_parallel:
        seq //= groups.tp.size()
    shape = (seq, micro_batch_size, config.hidden_size)
    if adjust is not None:
        recv_shapes, send_shapes = adjust([shape], [shape])
        if len(recv_shapes) != 1 or len(send_shapes) != 1 or tuple(recv_shapes[0]) != tuple(send_shapes[0]):
            raise ValueError("adjust_tensor_shapes_fn must keep one boundary tensor of one shape for megatron-zb")
        shape = tuple(recv_shapes[0])
    return shape


@contextlib.contextmanager
def grad_sync_disabled(config, models: list, forward_only: bool):
    """Every B and W runs under no_sync; each chunk's reduction starts after its last W."""
    no_sync = config.no_sync_func
    with contextlib.ExitStack() as stack:
        if no_sync is not None and not forward_only:
            for func in no_sync if isinstance(no_sync, list) else [no_sync]:
                stack.enter_context(func())
        yield


def loss_rank_tokens(num_tokens: torch.Tensor | None, pp: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Token count on every pipeline rank, whichever rank computed the loss.

    finalize_model_grads broadcasts it from the last pipeline rank; with a V placement the
    loss is on rank 0, so sum it over the pipeline first (only the loss rank has a count).
    """
    tokens = num_tokens if num_tokens is not None else torch.zeros((), dtype=torch.int)
    tokens = tokens.to(device=device, dtype=torch.int).reshape(())
    dist.all_reduce(tokens, group=pp)
    return tokens


def ship_to_last_rank(store: list, schedule: Schedule, pp: dist.ProcessGroup, device: torch.device) -> list:
    """Move each pipe's loss-rank forward data to the last pipeline rank, in pipe order ([] stays behind).

    Megatron-LM reads and logs the losses there only. Pipes carry consecutive microbatches (pipe 0
    the first ones), so pipe order is microbatch order.
    """
    last, rank = pp.size() - 1, pp.rank()
    sources = [placement.rank_of(placement.num_stages - 1) for placement in schedule.placements]
    if rank not in (last, *sources) or all(source == last for source in sources):
        return store
    if rank != last:
        peer = dist.get_global_rank(pp, last)
        dist.send_object_list(
            [_to_device(store, torch.device("cpu"))], dst=peer, group=pp, device=_object_device(pp, device)
        )
        return []
    gathered: dict[int, list] = {}
    for source in dict.fromkeys(sources):
        if source == last:
            gathered[source] = store
            continue
        payload = [None]
        dist.recv_object_list(
            payload, src=dist.get_global_rank(pp, source), group=pp, device=_object_device(pp, device)
        )
        gathered[source] = _to_device(payload[0], device)
    return [entry for source in dict.fromkeys(sources) for entry in gathered[source]]


def _object_device(group: dist.ProcessGroup, device: torch.device) -> torch.device | None:
    return device if dist.get_backend(group) == "nccl" else None


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value
