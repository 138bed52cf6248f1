"""The launcher's flags: a subset of Megatron-LM's, with its names and defaults, plus ours (``flags/launcher.py``).

A user's pretrain_gpt command line runs here unchanged for the flags we share; every other flag is
refused by name, all in one message, before anything starts (``flag_surface``: with Megatron-LM's own
parser where it can be imported, so that a Megatron-LM flag the launcher lacks is told apart from a typo).
``parse(argv)`` also derives what Megatron-LM derives (data-parallel size, FFN size, padded
vocabulary) and runs every check that needs no process group.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..flags.launcher import LAUNCHER_FLAGS, TOKENIZERS
from ..flags.table import add_to
from ..megatron.args import add_args, schedule_settings
from ..schedule.placement import Placement, linear
from . import checks, flag_surface, memory_fit, moe_checks
from .manifest import check_before_spawn

# Megatron-LM's --tokenizer-type values that megatron-core's tokenizers build from local files (TOKENIZERS: all).
NULL_TOKENIZER = "NullTokenizer"
FILE_TOKENIZERS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
}
TOKENIZER_PACKAGES = {
    "GPT2BPETokenizer": "transformers",
    "HuggingFaceTokenizer": "transformers",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser: the table's launcher rows (``flags/launcher.py``), then the zero-bubble group."""
    parser = argparse.ArgumentParser(
        prog="megatron-zb train",
        description="Train a GPT with megatron-core and a megatron-zb schedule (Megatron-LM's pretrain_gpt flags).",
    )
    add_to(parser, LAUNCHER_FLAGS)
    add_args(parser)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, derive Megatron-LM's computed values, and refuse what cannot run (SystemExit with the reason)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        notes = flag_surface.check(argv, parser)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    args = parser.parse_args(flag_surface.without_no_effect_flags(argv, parser))
    try:
        notes += derive_and_check(args)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank parses: warn once
        for note in notes:
            print(f"{parser.prog}: warning: {note}", file=sys.stderr)
    return args


def derive_and_check(args: argparse.Namespace) -> list[str]:
    """Fill derived fields and refuse bad settings (ValueError names the flag); returns warnings for flags that
    have no effect. Nothing has started yet, and every path the run writes is checked writable (see checks.py)."""
    checks.check_given(args)
    given = checks.given(args, build_parser())
    world = _world_size(args)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"{world} processes do not split into tensor ({args.tensor_model_parallel_size}) x pipeline "
            f"({args.pipeline_model_parallel_size}) groups; use a multiple of {model_parallel}"
        )
    args.world_size = world
    args.data_parallel_size = world // model_parallel
    args.ffn_hidden_size = args.ffn_hidden_size or checks.default_ffn_hidden_size(args)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * args.data_parallel_size
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _check_data(args)
    _check_model(args)
    notes = moe_checks.check_moe(args)
    checks.check_derived(args)
    checks.check_architecture(args)
    checks.refuse_cpu_flags(args)
    args.tokenizer_vocab_size = tokenizer_vocab(args)
    args.padded_vocab_size = padded_vocab(args.tokenizer_vocab_size, args.make_vocab_size_divisible_by, args)
    if args.cpu:  # the processes start here: their memory is this machine's
        memory_fit.check_fits(args, args.data_parallel_size)
    args.zero_bubble = schedule_settings(args)
    args.placements = args.zero_bubble.placements if args.zero_bubble is not None else (placement_of(args),)
    args.placement = args.placements[0]  # a Namespace holds values, not properties: the first pipe's, set here only
    checks.check_placement(args)
    moe_checks.check_moe_schedule(args)
    checks.check_zero3(args)
    checks.check_replan_window(args)
    check_before_spawn(args)  # --load/--save against the checkpoints there (manifest.py)
    checks.check_outputs(args)
    return notes + checks.unused(args, given)


def _world_size(args: argparse.Namespace) -> int:
    import os

    if args.cpu:
        return args.cpu_procs or args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.cpu_procs is not None:
        raise ValueError("--cpu-procs needs --cpu (on GPUs the process count comes from torchrun/srun)")
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_data(args: argparse.Namespace) -> None:
    import os

    if args.data_path and args.mock_data:
        raise ValueError("--data-path and --mock-data are exclusive; give one")
    if not args.data_path and not args.mock_data:
        raise ValueError(
            "give --mock-data (synthetic sequences) or --data-path PREFIX (a megatron-core indexed dataset, "
            "PREFIX.bin and PREFIX.idx)"
        )
    if args.tokenizer_type is None:
        if args.data_path:
            raise ValueError(
                f"--data-path needs --tokenizer-type (as Megatron-LM's pretrain_gpt): one of {', '.join(TOKENIZERS)}"
            )
        if args.vocab_size is None:
            raise ValueError("--mock-data needs --vocab-size (as Megatron-LM's NullTokenizer does)")
    elif args.tokenizer_type == NULL_TOKENIZER and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size (its ids are 0 .. N-1, N is the eod)")
    for flag in FILE_TOKENIZERS.get(args.tokenizer_type, ()):
        path = getattr(args, flag)
        option = "--" + flag.replace("_", "-")
        if path is None:
            raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs {option} FILE (it reads its vocabulary)")
        if not os.path.exists(path):
            raise ValueError(f"{option} {path}: no such file")
    for prefix in _prefixes(args.data_path or []):
        missing = [prefix + suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
        if missing:
            raise ValueError(
                f"--data-path {prefix}: {' and '.join(missing)} not found (give the prefix of a megatron-core "
                "indexed dataset, without .bin/.idx)"
            )


def _prefixes(data_path: list[str]) -> list[str]:
    """The dataset prefixes of --data-path ("PREFIX ..." or "WEIGHT PREFIX ...", as Megatron-LM reads it)."""
    from .data import split_blend

    return split_blend(data_path)[0]


def tokenizer_vocab(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary, before padding, as Megatron-LM's build_tokenizer computes it.

    Asked of megatron-core's own tokenizer: its NullTokenizer holds ``--vocab-size`` ids plus
    an end-of-document id in 0.16 (``vocab_size + 1``) and ``--vocab-size`` ids with the last
    one the end of document from 0.17 on. Without --tokenizer-type (mock data only), the
    model's vocabulary is ``--vocab-size`` itself, as this launcher always took it.
    """
    if args.tokenizer_type is None:
        return args.vocab_size
    if args.tokenizer_type == NULL_TOKENIZER:
        from .data import make_tokenizer

        return int(make_tokenizer(args).vocab_size)
    import importlib.util

    from .data import make_tokenizer

    package = TOKENIZER_PACKAGES[args.tokenizer_type]
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"--tokenizer-type {args.tokenizer_type}: megatron-core builds it with the {package} package, which is "
            f"not installed; install {package}, or use --tokenizer-type NullTokenizer"
        )
    try:
        return int(make_tokenizer(args).vocab_size)
    except Exception as error:  # megatron-core wraps what the library raised; name the flag and the files
        files = ", ".join(str(getattr(args, flag)) for flag in FILE_TOKENIZERS[args.tokenizer_type])
        raise ValueError(
            f"--tokenizer-type {args.tokenizer_type}: megatron-core could not build it from {files}: {error}"
        ) from error


def _check_model(args: argparse.Namespace) -> None:
    if args.context_parallel_size > 1:
        raise ValueError(
            "--context-parallel-size > 1 is not supported by this launcher yet; use tensor or data parallelism"
        )
    if args.trace_file and not _zero_bubble_flags(args):
        raise ValueError(
            "--trace-file traces megatron-zb's passes: choose a schedule (e.g. --pipeline-schedule 1f1b, the same "
            "schedule as megatron-core's default)"
        )
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are exclusive; choose one")
    if args.num_attention_heads % args.tensor_model_parallel_size:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} does not divide by --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size}"
        )
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save DIRECTORY")
    if args.trace_iteration is not None and not args.trace_file:
        raise ValueError("--trace-iteration needs --trace-file FILE")
    if args.trace_iteration is not None and not 1 <= args.trace_iteration <= args.train_iters:
        raise ValueError(f"--trace-iteration must be between 1 and --train-iters {args.train_iters}")


def _zero_bubble_flags(args: argparse.Namespace) -> bool:
    from ..megatron.args import enabled

    return enabled(args)


def padded_vocab(vocab: int, divisible_by: int, args: argparse.Namespace) -> int:
    """Megatron-LM's padding: a multiple of divisible_by x tensor-parallel size."""
    multiple = divisible_by * args.tensor_model_parallel_size
    return -(-vocab // multiple) * multiple


def placement_of(args: argparse.Namespace) -> Placement:
    """Where the layer blocks go: the schedule's placement, or megatron-core's for its own schedules."""
    if args.zero_bubble is not None:
        return args.zero_bubble.placement
    from ..megatron.args import check_layers, virtual_chunks
    from ..schedule import ScheduleSpec, build

    pp, vp = args.pipeline_model_parallel_size, virtual_chunks(args)
    if vp is not None and vp > 1:
        reference = build("interleaved-1f1b", ScheduleSpec(pp, max(pp, 1), vp))
    else:
        reference = build("1f1b", ScheduleSpec(pp, 1))
    check_layers(args.num_layers, reference, bool(args.allow_padding_num_layers))
    return reference.placement if pp > 1 else linear(1)
