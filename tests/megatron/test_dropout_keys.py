"""Order-independent dropout (``megatron_zb.megatron.dropout_keys``): the masks of a layer depend on the seed, the
microbatch's forward and the layer's number, not on the order of forwards, the pipeline split or other draws.

One gloo rank in the pytest process, megatron-core's GPTModel on CPU (local spec), dropout 0.3, two chunks: run
microbatch by microbatch against breadth-first (every microbatch through the first chunk, then through the second)
with other random draws in between; and full activation recomputation against none, which must replay the masks.
Independence of the pipeline split is checked through Megatron-LM (tests/megatron/test_real_megatron_lm.py: zb-v,
whose rank 0 holds the first and the last layer, against 1F1B).
"""

from __future__ import annotations

import pytest
import torch

from megatron_zb.megatron import dropout_keys
from megatron_zb.megatron.init import placement_independent_init
from megatron_zb.testing.parallel import one_gloo_rank
from megatron_zb.testing.toy_gpt import ToyGPT, loss_func, reference_step

TOY = ToyGPT(layers=4, micro_batch=2, seq=8)
DROPOUT = dict(hidden_dropout=0.3, attention_dropout=0.3)
SEED = 77


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu():
    with one_gloo_rank():
        yield


def blocks(chunks: int, keyed: bool = True, **overrides) -> list:
    """The model as ``chunks`` blocks of one rank (layer numbers 1-4 across them), weights from the seed."""
    config = TOY.config(1, chunks, **{**DROPOUT, **overrides})
    built = [TOY.block(config, block, chunks, block if chunks > 1 else None) for block in range(chunks)]
    placement_independent_init(built, config, TOY.seed)
    if keyed:
        dropout_keys.install(built, SEED)
    return built


def breadth_first(chain: list, batches: list[dict]) -> list[float]:
    """Every microbatch through the first block, then through the next (other draws in between); backward."""
    hidden = [None] * len(batches)
    for model in chain:
        for index, batch in enumerate(batches):
            torch.rand(7)  # someone else's draw: must not move the masks
            model.set_input_tensor(hidden[index])
            pre, post = model.pre_process, model.post_process
            hidden[index] = model(
                batch["tokens"] if pre else None,
                batch["position_ids"] if pre else None,
                None,
                labels=batch["labels"] if post else None,
            )
    losses = []
    for batch, output in zip(batches, hidden, strict=True):
        loss, tokens, _ = loss_func(batch["loss_mask"], output)
        (loss / tokens / len(batches)).backward()
        losses.append(float(loss.detach()))
    return losses


def grads(chain: list) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.grad.clone() for i, m in enumerate(chain) for name, p in m.named_parameters()}


def test_masks_follow_the_microbatch_and_the_layer_not_the_order_or_other_draws() -> None:
    batches = TOY.batches(3)
    in_order = reference_step(blocks(2), batches)  # microbatch by microbatch through both chunks
    torch.manual_seed(2)  # another generator state at the start: no effect either
    assert breadth_first(blocks(2), batches) == in_order
    unkeyed = blocks(2, keyed=False)
    torch.manual_seed(2)
    assert breadth_first(unkeyed, batches) != in_order  # without keys: the order's masks
    assert reference_step(blocks(2, hidden_dropout=0.0, attention_dropout=0.0), batches) != in_order  # drawn at all


def test_recomputation_replays_the_keyed_masks() -> None:
    batches = TOY.batches(2)
    plain = blocks(2)
    recomputed = blocks(2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert breadth_first(recomputed, batches) == breadth_first(plain, batches)
    found, expected = grads(recomputed), grads(plain)
    assert found.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(found[name], grad), name


def test_the_generators_are_given_back_as_found() -> None:
    chain = blocks(2)
    batches = TOY.batches(1)
    torch.manual_seed(5)
    breadth_first(chain, batches)
    after = torch.get_rng_state()
    undrawn = blocks(2, keyed=False, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(5)
    breadth_first(undrawn, batches)
    assert torch.equal(after, torch.get_rng_state())  # the keyed forwards drew nothing from the caller's stream
