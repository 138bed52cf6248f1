"""Initialisation that gives the same model whatever the placement, pipeline or tensor-parallel size.

megatron-core draws initial weights from the RNG state of the process that builds them, so a
V run and a linear run (or pp=2 and pp=4) start from different models and cannot be compared.
Here every parameter is drawn from its own generator, seeded by (seed, a name that does not
depend on where the parameter lives): decoder layers by their global layer number, MoE experts
by their global expert number (whatever the expert-parallel size), the rest by their name in the
unpipelined model. The tied output layer takes the embedding's values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch

_LAYERS = "decoder.layers."
_EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_SCALED = ("linear_proj", "linear_fc2")  # residual-branch outputs: megatron's scaled_init_method_normal
_EXPERTS = "mlp.experts.local_experts."  # SequentialMLP's experts, numbered within this expert-parallel rank


def placement_independent_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name in the unpipelined model, parameter) for every parameter of a GPTModel chunk.

    Decoder layer indices become global (``layer_number - 1``), and so do local expert indices
    (the MoE layer's ``local_expert_indices``); a tied output layer is named after the word
    embedding it copies.
    """
    while hasattr(model, "module"):
        model = model.module
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", [])
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    for name, param in model.named_parameters():
        key = name
        if name.startswith(_LAYERS):
            index, rest = name[len(_LAYERS) :].split(".", 1)
            layer = layers[int(index)]
            if rest.startswith(_EXPERTS):
                local, tail = rest[len(_EXPERTS) :].split(".", 1)
                rest = f"{_EXPERTS}{layer.mlp.local_expert_indices[int(local)]}.{tail}"
            key = f"{_LAYERS}{layer.layer_number - 1}.{rest}"
        elif tied and name == "output_layer.weight":
            key = _EMBEDDINGS[0]
        yield key, param


def placement_independent_init(chunks: list, config, seed: int) -> None:
    """Re-initialise every parameter of ``chunks`` from (``seed``, its placement-independent name).

    Weights ~ normal(0, init_method_std) (embeddings: embedding_init_method_std; linear_proj
    and linear_fc2: init_method_std / sqrt(2 * num_layers)), layernorm weights 1 (0 with
    zero-centred gamma), biases 0. Tensor-parallel weights are drawn whole and sliced as
    megatron's ``_initialize_affine_weight_cpu`` does; one full parameter is in memory at a
    time. MoE experts (SequentialMLP's; not expert-parallel all-reduced, ``allreduce=False``) are
    sliced by their expert-tensor-parallel rank. Call it before building the optimizer (it keeps
    its own copy of the weights).
    """
    from megatron.core import parallel_state

    initialized = parallel_state.model_parallel_is_initialized()
    tp = (
        (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
        if initialized
        else (0, 1)
    )
    etp = (
        (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
        if initialized
        else (0, 1)
    )
    with torch.no_grad():
        for chunk in chunks:
            for key, param in placement_independent_names(chunk):
                fill, std = _rule(key, param, config)
                if fill is not None:
                    param.data.fill_(fill)
                else:
                    param.data.copy_(_drawn(key, param, std, seed, *(tp if _dense(key, param) else etp)))


def _dense(key: str, param: torch.nn.Parameter) -> bool:
    """Not an expert's: split by the tensor-parallel group (an expert's by the expert-tensor-parallel group)."""
    if getattr(param, "allreduce", True):
        return True
    if f".{_EXPERTS}" not in key:
        raise ValueError(
            f"placement_independent_init does not handle expert-parallel parameters other than SequentialMLP's "
            f"({key}); leave the model's own initialisation for grouped-GEMM experts"
        )
    return False


def _rule(key: str, param: torch.nn.Parameter, config) -> tuple[float | None, float]:
    """(constant to fill, or None to draw; the normal's std) for one parameter, by megatron's conventions."""
    *_, owner, leaf = ("", *key.split("."))
    if key in _EMBEDDINGS:
        return None, getattr(config, "embedding_init_method_std", None) or config.init_method_std
    if leaf == "bias" or leaf.endswith("_bias"):
        return 0.0, 0.0
    if "norm" in owner or leaf == "layer_norm_weight":
        return (0.0 if getattr(config, "layernorm_zero_centered_gamma", False) else 1.0), 0.0
    if param.dim() >= 2:
        if owner in _SCALED:
            multiplier = 1.0 if getattr(config, "is_hybrid_model", False) else 2.0
            return None, config.init_method_std / math.sqrt(multiplier * config.num_layers)
        return None, config.init_method_std
    raise ValueError(
        f"placement_independent_init does not know how to initialise {key} (shape {tuple(param.shape)}); "
        "it handles linear and embedding weights, biases and layernorm weights"
    )


def _drawn(key: str, param: torch.nn.Parameter, std: float, seed: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's part of the full tensor drawn for ``key`` (fp32, on the CPU)."""
    split = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
    shape = list(param.shape)
    dim = getattr(param, "partition_dim", -1)
    if split:
        shape[dim] *= tp_size
    generator = torch.Generator().manual_seed(seed_of(seed, key))
    full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    if not split:
        return full
    stride = getattr(param, "partition_stride", 1)
    if param.shape[dim] % stride:
        raise ValueError(f"{key}: partition of {param.shape[dim]} does not divide by partition_stride {stride}")
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def seed_of(*key: object) -> int:
    """A 63-bit seed from ``key``'s parts joined by "/", the same in every process (Python's hash is salted)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
