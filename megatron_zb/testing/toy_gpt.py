"""A small megatron-core GPTModel cut into the blocks of any placement, with mock data.

Block ``b`` of a schedule's placement is built with the seed ``seed + b`` whatever rank
builds it, so the chunks a rank runs and an unpipelined chain of all blocks (the
reference) start from identical weights. Each block holds ``layers / (pp * chunks)``
transformer layers; block 0 has the embedding, the last block the output layer and loss.
``llama=True`` builds the Llama family's layers instead of GPT-2's (see ``LLAMA``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

# Llama-style layers: SwiGLU, RMSNorm, 4 query heads per key/value head with head channels that are not
# hidden / heads, no biases, q/k normalisation; with RoPE (Llama 3's base and frequency scaling) below.
LLAMA = dict(
    gated_linear_unit=True,
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    num_query_groups=1,
    kv_channels=16,
    ffn_hidden_size=48,
    add_bias_linear=False,
    qk_layernorm=True,
)
LLAMA_ROPE = dict(position_embedding_type="rope", rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0)


@dataclass(frozen=True)
class ToyGPT:
    layers: int = 8
    hidden: int = 32
    heads: int = 4
    vocab: int = 64
    seq: int = 16
    micro_batch: int = 2
    seed: int = 1234
    dtype: torch.dtype = torch.float32
    heavy_block: int | None = None
    heavy_factor: int = 3
    llama: bool = False  # LLAMA layers and LLAMA_ROPE positions instead of GPT-2's

    def config(self, pp: int, chunks: int, tp: int = 1, **overrides):
        from megatron.core.transformer import TransformerConfig

        fields = dict(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
            pipeline_dtype=self.dtype,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            deallocate_pipeline_outputs=True,
            batch_p2p_sync=False,
        )
        if self.llama:
            fields.update(LLAMA, activation_func=torch.nn.functional.silu)
        fields.update(overrides)
        return TransformerConfig(**fields)

    @staticmethod
    def layer_spec(config):
        """megatron-core's local layer spec with the config's norm and q/k normalisation."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)

    @property
    def positions(self) -> dict:
        """GPTModel's position-embedding arguments: learned positions, or LLAMA_ROPE."""
        return dict(LLAMA_ROPE) if self.llama else {}

    def block(self, config, block: int, num_blocks: int, chunk: int | None = None):
        """One layer block as a GPTModel (embedding on block 0, output layer and loss on the last)."""
        from megatron.core.models.gpt import GPTModel

        if block == self.heavy_block:
            config = replace(config, num_layers=config.num_layers * self.heavy_factor)
        torch.manual_seed(self.seed + block)
        return GPTModel(
            config=config,
            transformer_layer_spec=self.layer_spec(config),
            vocab_size=self.vocab,
            max_sequence_length=self.seq,
            pre_process=block == 0,
            post_process=block == num_blocks - 1,
            share_embeddings_and_output_weights=False,
            vp_stage=chunk if config.virtual_pipeline_model_parallel_size else None,
            **self.positions,
        )

    def chunks(self, config, schedule, rank: int) -> list:
        """This rank's model chunks for ``schedule``'s placements, in chunk order (a pipe's block: the same weights
        whatever the pipe, so the copies of a block kept twice start equal)."""
        found = {}
        for placement in schedule.placements:
            pipe_config = self._for(config, placement)
            for block, (owner, chunk) in enumerate(placement.blocks):
                if owner == rank:
                    vp_stage = chunk - placement.chunk_base
                    found[chunk] = self.block(pipe_config, block, placement.num_stages, vp_stage)
        return [found[chunk] for chunk in sorted(found)]

    def all_blocks(self, config, placement) -> list:
        """Every block of ``placement`` in layer order (the unpipelined reference)."""
        n, config = placement.num_stages, self._for(config, placement)
        return [self.block(config, block, n, placement.chunk_of(block) - placement.chunk_base) for block in range(n)]

    @staticmethod
    def _for(config, placement):
        """The config of one pipe: its own chunk count (a schedule with two pipes has both on every rank)."""
        chunks = placement.chunks if placement.chunks > 1 else None
        if config.virtual_pipeline_model_parallel_size == chunks:
            return config
        return replace(config, virtual_pipeline_model_parallel_size=chunks)

    def batches(self, count: int, stream: int = 0) -> list[dict]:
        """``count`` microbatches; ``stream`` tells data-parallel replicas apart."""
        generator = torch.Generator().manual_seed(self.seed * 7919 + stream)
        found = []
        for _ in range(count):
            tokens = torch.randint(0, self.vocab, (self.micro_batch, self.seq + 1), generator=generator)
            mask = (torch.rand(self.micro_batch, self.seq, generator=generator) > 0.1).float()
            found.append(
                {
                    "tokens": tokens[:, :-1].contiguous(),
                    "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": mask,
                    "position_ids": torch.arange(self.seq).expand(self.micro_batch, self.seq).contiguous(),
                }
            )
        return found

    def with_dtype(self, dtype: torch.dtype) -> ToyGPT:
        return replace(self, dtype=dtype)

    def step(self, forward_backward, chunks: list, batches: list[dict], **kwargs):
        """One ``forward_backward`` call over ``batches``, one data iterator per chunk."""
        return forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=self.seq,
            micro_batch_size=self.micro_batch,
            **kwargs,
        )


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """pretrain_gpt's form: (sum of masked token losses, token count, dict for logging)."""
    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    """A pretrain_gpt-style forward step: only the chunks with embedding or loss read data."""
    from megatron.core.utils import get_attr_wrapped_model

    pre = get_attr_wrapped_model(model, "pre_process")
    post = get_attr_wrapped_model(model, "post_process")
    batch = next(data_iterator) if (pre or post) else None
    tokens = batch["tokens"] if pre else None
    positions = batch["position_ids"] if pre else None
    labels = batch["labels"] if post else None
    output = model(tokens, positions, None, labels=labels)
    mask = batch["loss_mask"] if post else None
    return output, partial(loss_func, mask)


def reference_step(blocks: list, batches: list[dict], num_microbatches: int | None = None) -> list[float]:
    """Run every microbatch through all blocks in order, unpipelined; gradients accumulate.

    The loss is scaled as megatron-core's schedules do (per token, then per microbatch).
    Returns each microbatch's summed token loss.
    """
    m = num_microbatches or len(batches)
    losses = []
    for batch in batches:
        hidden = None
        for model in blocks:
            model.set_input_tensor(hidden)
            pre, post = model.pre_process, model.post_process
            hidden = model(
                batch["tokens"] if pre else None,
                batch["position_ids"] if pre else None,
                None,
                labels=batch["labels"] if post else None,
            )
        loss, tokens, _ = loss_func(batch["loss_mask"], hidden)
        (loss / torch.clamp(tokens, min=1) / m).backward()
        losses.append(float(loss.detach()))
    return losses
