"""Training and validation batches: mock sequences or megatron-core indexed GPT datasets.

Both are addressed by global sample index, as Megatron's pretraining sampler reads them: the
samples of iteration ``i`` are ``(i - 1) * global_batch ...``, each data-parallel rank reads its
own micro-batch slice, and a resumed run continues with exactly the batches it would have seen.

Mock sample ``i`` is an arithmetic sequence modulo the vocabulary whose start and stride come
from (seed, i), so a small GPT learns it within a few dozen iterations and the loss visibly
falls. ``--data-path`` datasets are megatron-core's own ``GPTDataset`` (built with
``BlendedMegatronDatasetBuilder``, split by ``--split``, sized as Megatron-LM sizes them).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch

STRIDES = (1, 2, 3, 5)
_STREAM = 1 << 40  # mock validation samples: a stream of indices no training sample reaches


class Batches:
    """Micro-batches of one data-parallel rank, cut from samples addressed by global index.

    Subclasses are dataclasses with ``micro_batch``, ``global_batch``, ``dp_size``, ``dp_rank``.
    """

    micro_batch: int
    global_batch: int
    dp_size: int
    dp_rank: int

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index``: tokens, labels, loss_mask, position_ids, each of --seq-length."""
        raise NotImplementedError

    def microbatch(self, iteration: int, microbatch: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``microbatch`` of (1-based) ``iteration`` for this data-parallel rank."""
        first = (iteration - 1) * self.global_batch + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch
        rows = [self.row(first + offset) for offset in range(self.micro_batch)]
        return {key: torch.stack([row[key] for row in rows]).contiguous() for key in rows[0]}

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def iterator(self, iteration: int, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
        """The micro-batches of one iteration, in order (one such iterator per model chunk)."""
        for microbatch in range(self.microbatches):
            yield {key: value.to(device) for key, value in self.microbatch(iteration, microbatch).items()}


@dataclass(frozen=True)
class MockData(Batches):
    vocab: int
    seq: int
    micro_batch: int
    global_batch: int
    dp_size: int
    dp_rank: int
    seed: int
    stream: int = 0  # 0: training samples, 1: validation samples

    def sample(self, index: int) -> torch.Tensor:
        """``seq + 1`` tokens of sample ``index``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index + self.stream * _STREAM)
        start = int(torch.randint(0, self.vocab, (1,), generator=generator))
        stride = STRIDES[int(torch.randint(0, len(STRIDES), (1,), generator=generator))]
        return (start + stride * torch.arange(self.seq + 1)) % self.vocab

    def row(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.sample(index)
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": torch.ones(self.seq),
            "position_ids": torch.arange(self.seq),
        }


@dataclass(frozen=True)
class DatasetBatches(Batches):
    """Batches of a megatron-core dataset (``GPTDataset`` or a blend): its samples in index order."""

    dataset: object
    micro_batch: int
    global_batch: int
    dp_size: int
    dp_rank: int

    def row(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.dataset[index % len(self.dataset)]
        return {key: torch.as_tensor(sample[key]) for key in ("tokens", "labels", "loss_mask", "position_ids")}


@dataclass(frozen=True)
class Sources:
    train: Batches
    valid: Batches | None  # None: no evaluation (--eval-iters 0, or an empty validation split)


def sources(args: argparse.Namespace, dp_size: int, dp_rank: int) -> Sources:
    """This rank's training and validation batches (every rank calls it: the dataset build synchronises)."""
    batch = (args.micro_batch_size, args.global_batch_size, dp_size, dp_rank)
    if not args.data_path:
        vocab = args.padded_vocab_size
        train = MockData(vocab, args.seq_length, *batch, args.seed)
        valid = MockData(vocab, args.seq_length, *batch, args.seed, stream=1) if args.eval_iters else None
        return Sources(train, valid)
    train, valid, _test = build_datasets(args)
    return Sources(
        DatasetBatches(train, *batch),
        DatasetBatches(valid, *batch) if valid is not None and args.eval_iters else None,
    )


def dataset_sizes(args: argparse.Namespace) -> list[int]:
    """Samples per split, as Megatron-LM's ``get_train_valid_test_num_samples``."""
    evaluations = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return [
        args.train_iters * args.global_batch_size,
        evaluations * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]


def split_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights or None) of --data-path, as megatron-core's ``get_blend_from_list``."""
    words = " ".join(data_path).split()
    if len(words) == 1:
        return words, None
    try:
        weights = [float(word) for word in words[0::2]]
    except ValueError:
        return words, None
    return words[1::2], weights


def build_datasets(args: argparse.Namespace) -> list:
    """megatron-core's GPTDataset splits (train, valid, test; None where a split is empty).

    Built on every rank: megatron-core builds on rank 0 first (writing the index cache), then
    on the others behind a barrier. The index helpers are megatron-core's compiled
    ``helpers_cpp`` extension, which the megatron-core wheel ships built.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = split_blend(args.data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=(prefixes, weights),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=make_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # the local layer spec masks causally by itself
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, dataset_sizes(args), lambda: True, config).build()


def make_tokenizer(args: argparse.Namespace):
    """megatron-core's tokenizer for --tokenizer-type (built from local files only).

    megatron-core moved ``build_tokenizer`` (``tokenizers.text.utils`` in 0.16,
    ``tokenizers.utils`` from 0.17 on) and renamed some of the fields it reads; the namespace
    carries both spellings, at Megatron-LM's defaults.
    """
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    except ImportError:
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    return build_tokenizer(
        SimpleNamespace(
            tokenizer_type=args.tokenizer_type or "NullTokenizer",
            vocab_size=args.vocab_size,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            tokenizer_metadata=None,  # 0.16
            metadata_path=None,  # 0.17 on
            pad_vocab_size=False,  # 0.17 on: the launcher pads (arguments.padded_vocab)
            tokenizer_special_tokens=None,  # 0.16
            special_tokens=None,  # 0.17 on
            tokenizer_hf_use_fast=False,  # 0.16
            tokenizer_hf_no_use_fast=False,  # 0.17 on
            tokenizer_hf_include_special_tokens=False,  # 0.16
            tokenizer_hf_no_include_special_tokens=False,  # 0.17 on
            trust_remote_code=False,
            chat_template=None,
            tokenizer_sentencepiece_legacy=False,
            tokenizer_sentencepiece_ignore_extra_whitespaces=True,
            tiktoken_pattern=None,
            tiktoken_num_special_tokens=1000,
        )
    )
