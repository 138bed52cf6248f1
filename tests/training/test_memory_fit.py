"""A --cpu run that cannot fit in this machine's memory is refused before any process starts, naming the flag."""

from __future__ import annotations

import argparse

import pytest

from megatron_zb import pretrain_gpt
from megatron_zb.training import memory_fit

BASE = (
    "--cpu --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --mock-data --micro-batch-size 1 "
    "--train-iters 2 --lr 1e-3 --pipeline-model-parallel-size 2"
).split()


def gpt(**fields) -> argparse.Namespace:
    model = dict(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, padded_vocab_size=50304,
        max_position_embeddings=1024, seq_length=1024, micro_batch_size=1, optimizer="adam",
        position_embedding_type="learned_absolute",
    )  # fmt: skip
    return argparse.Namespace(**{**model, **fields})


def test_gpt2_small_counts_its_124m_parameters() -> None:
    layers, embedding = memory_fit.parameter_count(gpt())
    assert layers + embedding == pytest.approx(124_439_808, rel=0.01)  # GPT-2 small, padded vocabulary


def test_llama_3_8b_counts_its_8b_parameters() -> None:
    llama = gpt(num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                num_query_groups=8, kv_channels=128, ffn_hidden_size=14336, swiglu=True, padded_vocab_size=128256,
                untie_embeddings_and_output_weights=True, position_embedding_type="rope")  # fmt: skip
    layers, embedding = memory_fit.parameter_count(llama)
    assert layers + embedding == pytest.approx(8.03e9, rel=0.01)


def test_a_vocabulary_one_digit_too_long_is_refused_before_spawning(monkeypatch, capsys) -> None:
    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", lambda args: pytest.fail("spawned"))
    with pytest.raises(SystemExit) as stopped:
        pretrain_gpt.main([*BASE, "--vocab-size", "1000000000000"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-zb train: error: this run needs at least") and "Traceback" not in err
    assert "most of it comes from --vocab-size (the embedding and output layer): lower it" in err


@pytest.mark.parametrize(
    "fields, heaviest",
    [
        ({"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 16384}, "--num-layers / --hidden-size"),
        ({"seq_length": 65536, "max_position_embeddings": 65536, "micro_batch_size": 8}, "--seq-length"),
    ],
)
def test_the_heaviest_flags_are_named(fields: dict, heaviest: str) -> None:
    with pytest.raises(ValueError, match=f"most of it comes from {heaviest}"):
        memory_fit.check_fits(gpt(**fields), data_parallel=1, memory=24 * memory_fit.GIB)
    memory_fit.check_fits(gpt(), data_parallel=1, memory=24 * memory_fit.GIB)  # GPT-2 small fits in 24 GiB
