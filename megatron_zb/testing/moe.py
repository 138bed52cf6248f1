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


def moe_gpt_stage(config, pp_rank: int, vocab: int, seq: int):
    """This pipeline rank's part of a GPT with ``config``'s layers (its embedding on the first, loss on the last)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=pp_rank == 0,
        post_process=pp_rank == config.pipeline_model_parallel_size - 1,
        share_embeddings_and_output_weights=False,
    )


def pair_adjacent(schedule):
    """``schedule`` with adjacent F and B (BW) passes of different microbatches paired as overlapped F&B, last
    rank first, left to right, each pair kept only where the schedule still validates (a pair whose backward
    needs its own forward through another rank would never start: F1 beside BW0 on both ranks of 1F1B). Every
    pair it can, whatever the costs: for tests and benchmarks (``pairing.overlap_pairs`` plans by cost)."""
    from dataclasses import replace

    from megatron_zb.schedule import PassKind
    from megatron_zb.schedule.validate import validate

    pairs: list = []
    for order in reversed(schedule.orders):
        index = 0
        while index + 1 < len(order):
            a, b = order[index], order[index + 1]
            kinds = {a.kind, b.kind}
            if PassKind.F in kinds and kinds & {PassKind.B, PassKind.BW} and a.microbatch != b.microbatch:
                pair = (a, b) if a.kind is PassKind.F else (b, a)
                if not validate(replace(schedule, overlapped=(*pairs, pair))):
                    pairs.append(pair)
                    index += 2
                    continue
            index += 1
    return replace(schedule, overlapped=tuple(pairs))
