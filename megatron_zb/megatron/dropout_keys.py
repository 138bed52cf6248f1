"""Dropout masks drawn from (seed, forward, layer), whatever the schedule, the re-plan or the pipeline layout.

Each rank draws its dropout masks in the order it runs forwards, from a generator Megatron-LM seeds with the
pipeline rank: an interleaved or V order, or another pipeline split, draws other masks than megatron-core's
1F1B, and the losses differ though the training math is the same. With ``--zero-bubble-order-independent-dropout``
every model chunk counts its forwards (each chunk runs its microbatches in order, in every schedule megatron-core
and megatron-zb run, so the k-th forward of a chunk is the same microbatch of the same iteration everywhere) and
seeds the generators from (``--seed``, that count) as it enters; every transformer layer and the embedding then
seeds them from that state and its layer number in the whole model, and gives them back as it found them when it
leaves. So a layer's masks depend on the seed, the forward and the layer alone.

Activation recomputation replays them: megatron-core's checkpoint restores the CPU generator it saved at its
entry, which is the chunk's state for that forward (every hooked module gives it back), and the layer derives
its seed from it again. On a GPU the CUDA generator and megatron-core's RNG-tracker streams are seeded the same
way, the model-parallel and expert streams offset by the ranks megatron-core offsets them by.

Cost, per layer and forward: two copies of the CPU generator's 5 KB state, a hash of it and a reseed (a few
microseconds; on a GPU also the CUDA and tracker states). Not covered: a forward run twice (post-validation's
redo of an iteration counts its forwards again, so the masks after a redo differ from a run without one).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterator, Sequence

import torch

from .gpt_model import unwrapped
from .init import seed_of

EMBEDDING = 0  # the embedding's "layer number"; transformer layers count from 1 in the whole model


def install(chunks: Sequence[torch.nn.Module], seed: int) -> list:
    """Hook every chunk, its transformer layers and its embedding; the hooks' handles (``handle.remove()``)."""
    handles = []
    for chunk in chunks:
        model = unwrapped(chunk)  # its forward runs once per microbatch
        if getattr(model, "megatron_zb_dropout_keys", False):
            continue
        model.megatron_zb_dropout_keys = True
        count = itertools.count()
        handles.append(model.register_forward_pre_hook(functools.partial(_enter_chunk, seed, count)))
        handles.append(model.register_forward_hook(_leave))
        for number, module in _drawing_modules(model):
            handles.append(module.register_forward_pre_hook(functools.partial(_enter_layer, number)))
            handles.append(module.register_forward_hook(_leave))
    return handles


def _drawing_modules(model: torch.nn.Module) -> Iterator[tuple[int, torch.nn.Module]]:
    """(layer number, module) of the modules that draw dropout: transformer layers and the embedding."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for module in model.modules():
        if isinstance(module, TransformerLayer):
            yield module.layer_number, module
        elif isinstance(module, LanguageModelEmbedding):
            yield EMBEDDING, module


def _enter_chunk(seed: int, count: Iterator[int], module: torch.nn.Module, args) -> None:
    _save(module)
    _seed_all(seed_of(seed, "forward", next(count)))


def _enter_layer(number: int, module: torch.nn.Module, args) -> None:
    _save(module)
    _seed_all(seed_of(_fingerprint(), "layer", number))


def _leave(module: torch.nn.Module, args, output) -> None:
    _restore(module.__dict__["megatron_zb_rng_saved"].pop())


def _fingerprint() -> int:
    """The CPU generator's state as a number: the chunk's state for this forward, at a layer's entry."""
    return int.from_bytes(hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).digest(), "little")


def _save(module: torch.nn.Module) -> None:
    module.__dict__.setdefault("megatron_zb_rng_saved", []).append(_states())


def _states() -> tuple:
    cuda = torch.cuda.get_rng_state() if _on_gpu() else None
    return torch.get_rng_state(), cuda, _tracker_states()


def _restore(states: tuple) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    if tracker:
        _tracker().set_states(tracker)


def _seed_all(seed: int) -> None:
    """The CPU generator (CPU dropout, and the state recomputation replays), and on a GPU the CUDA one and the
    tracker's streams (hidden dropout draws from the default stream, attention dropout from the model-parallel one)."""
    torch.manual_seed(seed)  # seeds the CUDA generators too, where CUDA is initialised
    streams = _tracker_states()
    if not streams or not _on_gpu():
        return
    current = torch.cuda.get_rng_state()
    seeded = {}
    for name in streams:
        torch.cuda.manual_seed(seed_of(seed, name, _stream_offset(name)))
        seeded[name] = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(current)
    _tracker().set_states(seeded)


def _stream_offset(name: str) -> int:
    """What megatron-core's ``model_parallel_cuda_manual_seed`` adds to a stream's seed per rank."""
    from megatron.core import parallel_state

    if name == "model-parallel-rng":
        return parallel_state.get_tensor_model_parallel_rank()
    if name == "expert-parallel-rng":
        return 100 * parallel_state.get_expert_model_parallel_rank() + parallel_state.get_expert_tensor_parallel_rank()
    return 0


def _on_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _tracker_states() -> dict:
    """The tracker's named streams; none on CPU (megatron-zb's CPU runs use megatron-core's no-op tracker)."""
    if not _on_gpu():
        return {}
    get_states = getattr(_tracker(), "get_states", None)
    return dict(get_states()) if get_states is not None else {}
