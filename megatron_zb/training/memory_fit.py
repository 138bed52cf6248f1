"""Whether a ``--cpu`` run fits in this machine's memory, estimated before any process starts.

A size typed one digit too long (``--vocab-size 1000000000000``) would otherwise be found out by the
ranks' first allocation, minutes in, or by the kernel's OOM killer. The estimate is coarse and errs low:
the model's parameters with their gradients and optimizer state (every data-parallel copy), and the
activations of the microbatches 1F1B keeps in flight, in fp32 as the CPU computes. A run is refused only
when even that exceeds the machine's physical memory; the message names the flags that weigh most.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

# fp32 weights and main gradients, plus the optimizer's state (Adam: two moments; SGD: momentum)
BYTES_PER_PARAMETER = {"adam": 16, "sgd": 12}
GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    parameters: int
    parameter_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.activation_bytes


def parameter_count(args: argparse.Namespace) -> tuple[int, int]:
    """(parameters of the transformer layers, of the embedding and output layer) of the whole model."""
    hidden, heads = args.hidden_size, args.num_attention_heads
    head_dim = getattr(args, "kv_channels", None) or hidden // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    ffn = args.ffn_hidden_size or 4 * hidden
    attention = hidden * head_dim * (heads + 2 * groups) + heads * head_dim * hidden
    mlp = hidden * ffn * (2 if getattr(args, "swiglu", False) else 1) + ffn * hidden
    layers = args.num_layers * (attention + mlp + 4 * hidden)
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 0
    tables = 2 if getattr(args, "untie_embeddings_and_output_weights", False) else 1
    embedding = vocab * hidden * tables
    if getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute":
        embedding += (getattr(args, "max_position_embeddings", None) or args.seq_length) * hidden
    return layers, embedding


def estimate(args: argparse.Namespace, data_parallel: int) -> Estimate:
    """The run's memory on this machine: every rank's share, summed (``data_parallel`` copies of the model)."""
    layers, embedding = parameter_count(args)
    parameters = layers + embedding
    per_parameter = BYTES_PER_PARAMETER.get(getattr(args, "optimizer", "adam"), 16)
    parameter_bytes = parameters * per_parameter * data_parallel
    tokens = args.seq_length * args.micro_batch_size
    # Megatron's per-layer activation count, s·b·h·(34 + 5·a·s/h) bytes in 16 bits, doubled for fp32;
    # 1F1B keeps pp microbatches in flight on the first stage, about one per layer on average.
    per_layer = tokens * args.hidden_size * (34 + 5 * args.num_attention_heads * args.seq_length / args.hidden_size)
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 0
    logits = 3 * 4 * tokens * vocab  # logits, their softmax and gradient, fp32, on the loss stage
    activation_bytes = int((2 * per_layer * args.num_layers + logits) * data_parallel)
    return Estimate(parameters, parameter_bytes, activation_bytes)


def machine_memory() -> int | None:
    """Physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(args: argparse.Namespace, data_parallel: int, memory: int | None = None) -> None:
    """ValueError, naming the heaviest flags, when even the low estimate exceeds this machine's memory."""
    memory = machine_memory() if memory is None else memory
    if memory is None:
        return
    found = estimate(args, data_parallel)
    if found.total <= memory:
        return
    layers, embedding = parameter_count(args)
    heaviest = (
        "--vocab-size (the embedding and output layer)"
        if embedding > layers and found.parameter_bytes >= found.activation_bytes
        else "--num-layers / --hidden-size / --ffn-hidden-size (the layers)"
        if found.parameter_bytes >= found.activation_bytes
        else "--seq-length / --micro-batch-size (the activations)"
    )
    raise ValueError(
        f"this run needs at least {found.total / GIB:,.1f} GiB ({found.parameters:,} parameters with their gradients "
        f"and optimizer state: {found.parameter_bytes / GIB:,.1f} GiB; activations: "
        f"{found.activation_bytes / GIB:,.1f} GiB) and this machine has {memory / GIB:,.1f} GiB; most of it comes "
        f"from {heaviest}: lower it"
    )
