"""A tiny megatron-core MoE layer configuration for CPU tests and benchmarks: the sizes are the caller's."""

from __future__ import annotations

from typing import Any


def moe_config(**sizes: Any):
    """A ``TransformerConfig`` for MoE layers on CPU (no dropout, no linear biases, top-2 routing, the alltoall
    dispatcher, weights made on the CPU); ``sizes`` sets the rest (layers, hidden size, heads, experts...) and
    may override any of these."""
    from megatron.core.transformer import TransformerConfig

    defaults = dict(
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
    )
    return TransformerConfig(**{**defaults, **sizes})
