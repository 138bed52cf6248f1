"""The launcher speaks pretrain_gpt: tokenizers, indexed datasets, evaluation, per-stage seeds.

One CLI run takes a pretrain_gpt command line (NullTokenizer, mock data, evaluation) as it is;
the other cases run ``run_rank`` in one pool of two gloo processes (pipeline 2): training on a
tiny megatron-core indexed dataset that the test writes with megatron-core's own builder, and
Megatron-LM's seeding. The refusals need no process.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import parse

TOLERANCE = 1e-5
PRETRAIN_GPT = (
    "--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 2 --seed 11"
)
TEXT = [f"document {index}: the quick brown fox jumps over the lazy dog, {index * 7} times" for index in range(48)]


def test_null_tokenizer_command_line_runs_unchanged() -> None:
    flags = (
        f"{PRETRAIN_GPT} --tokenizer-type NullTokenizer --vocab-size 256 --mock-data --eval-interval 2 --eval-iters 2"
    )
    args = parse([*flags.split(), "--cpu"])
    # megatron-core's NullTokenizer: 0.16 adds its end-of-document id to the 256 ids, 0.17 on makes it id 255.
    vocab = 257 if Version(version("megatron-core")) < Version("0.17") else 256
    assert args.tokenizer_vocab_size == vocab
    assert args.padded_vocab_size == (384 if vocab == 257 else 256)  # Megatron-LM's _vocab_size_with_padding
    command = [sys.executable, "-m", "megatron_zb", "train", "--cpu", *flags.split(), "--pipeline-schedule", "zb-v"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    validations = re.findall(
        r"validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|", done.stdout
    )
    assert [int(iteration) for iteration, _, _ in validations] == [2, 4]
    for _, loss, ppl in validations:
        assert math.isfinite(float(loss)) and float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert "iteration        4/       4" in done.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            "--tokenizer-type GPT2BPETokenizer --data-path corpus",
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file",
        ),
        ("--tokenizer-type NullTokenizer --mock-data", "--tokenizer-type NullTokenizer needs --vocab-size"),
        (
            "--tokenizer-type NullTokenizer --vocab-size 9 --data-path /nonexistent/corpus",
            "--data-path /nonexistent/corpus: /nonexistent/corpus.bin and /nonexistent/corpus.idx not found",
        ),
        ("--vocab-size 9 --data-path corpus", "--data-path needs --tokenizer-type"),
        ("--vocab-size 9 --mock-data --eval-interval 0", "--eval-interval must be at least 1, got 0"),
        # named, with the way out (test_flag_surface.py: with and without Megatron-LM's parser)
        ("--vocab-size 9 --mock-data --reset-attention-mask", "--reset-attention-mask"),
    ],
)
def test_refusals_name_the_flag(flags: str, message: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as raised:
        parse(f"{PRETRAIN_GPT} --cpu {flags}".split())
    assert raised.value.code == 2 and message in err.getvalue(), err.getvalue()


def test_a_tokenizer_without_its_package_is_named(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here")
    for name in ("vocab.json", "merges.txt", "corpus.bin", "corpus.idx"):
        (tmp_path / name).write_text("")
    flags = (
        f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path / 'vocab.json'} "
        f"--merge-file {tmp_path / 'merges.txt'} --data-path {tmp_path / 'corpus'}"
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse(f"{PRETRAIN_GPT} --cpu {flags}".split())
    assert "--tokenizer-type GPT2BPETokenizer: megatron-core builds it with the transformers package" in err.getvalue()


def write_dataset(folder: Path) -> str:
    """The test's text, tokenized with NullTokenizer (byte values as ids), written with megatron-core's builder."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_zb.training.data import make_tokenizer

    tokenizer = make_tokenizer(
        parse(f"{PRETRAIN_GPT} --cpu --tokenizer-type NullTokenizer --vocab-size 256 --mock-data".split())
    )
    prefix = str(folder / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for line in TEXT:
        ids = tokenizer.tokenize(" ".join(str(byte) for byte in line.encode()))
        builder.add_item(torch.tensor([*ids, tokenizer.eod]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


def train_case(args) -> dict:
    import torch

    from megatron_zb.pretrain_gpt import run_rank

    rows = run_rank(args, torch.device("cpu"), gloo=True)
    return {row["iteration"]: (row["loss"], row.get("valid_loss")) for row in rows if row["loss"] is not None}


def test_trains_on_an_indexed_dataset(pool: WorkerPool, tmp_path: Path) -> None:
    prefix = write_dataset(tmp_path)
    data = (
        f"--tokenizer-type NullTokenizer --vocab-size 256 --data-path {prefix} --split 90,8,2 "
        f"--data-cache-path {tmp_path / 'cache'} --eval-interval 2 --eval-iters 1"
    )
    runs = {}
    for name, schedule in (
        ("megatron-core", ""),
        ("1f1b", "--pipeline-schedule 1f1b"),
        ("zb-2p", "--pipeline-schedule zb-2p"),
    ):
        args = parse(f"{PRETRAIN_GPT} --cpu {data} {schedule}".split())
        found = [rows for rows in pool.run(train_case, args=args) if rows]
        assert len(found) == 1, "the last pipeline rank logs"
        runs[name] = found[0]
    reference = runs["megatron-core"]
    assert sorted(reference) == [1, 2, 3, 4]
    assert all(math.isfinite(loss) for loss, _ in reference.values())
    assert [i for i, (_, valid) in reference.items() if valid is not None] == [2, 4]
    for name, rows in runs.items():
        for iteration, (loss, valid) in reference.items():
            assert abs(rows[iteration][0] - loss) <= TOLERANCE * abs(loss), (name, iteration)
            if valid is not None:
                assert abs(rows[iteration][1] - valid) <= TOLERANCE * abs(valid), (name, iteration)
    mock = parse(
        f"{PRETRAIN_GPT} --cpu --tokenizer-type NullTokenizer --vocab-size 256 --mock-data --eval-iters 0".split()
    )
    mocked = [rows for rows in pool.run(train_case, args=mock) if rows][0]
    assert mocked[1][0] != reference[1][0], "the dataset's tokens, not mock data"


def seeds_case(args) -> dict:
    import random

    import numpy
    import torch
    from megatron.core import parallel_state

    from megatron_zb.training.build import init_parallel

    init_parallel(args, torch.device("cpu"))
    try:
        rank = parallel_state.get_pipeline_model_parallel_rank()
        return {
            "rank": rank,
            "torch": torch.initial_seed(),
            "numpy": int(numpy.random.get_state()[1][0]),
            "python": random.random(),
        }
    finally:
        from megatron_zb.process_groups import destroy_model_parallel

        destroy_model_parallel()


def test_each_pipeline_stage_seeds_as_megatron_lm(pool: WorkerPool) -> None:
    """Megatron-LM's _set_random_seed: seed + 100 x pipeline rank, for Python, NumPy and torch."""
    import random

    import numpy

    args = parse(f"{PRETRAIN_GPT} --cpu --vocab-size 64 --mock-data --seed 1234".split())
    for found in pool.run(seeds_case, args=args):
        seed = 1234 + 100 * found["rank"]
        random.seed(seed)
        assert found["torch"] == seed
        assert found["numpy"] == int(numpy.random.RandomState(seed).get_state()[1][0])
        assert found["python"] == random.random()
