"""The launcher's flags: a subset of Megatron-LM's, with its names and defaults, plus ours.

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

from ..megatron.args import add_args, schedule_settings
from ..schedule.placement import Placement, linear
from . import checks, flag_surface, memory_fit
from .manifest import check_before_spawn

# Megatron-LM's --tokenizer-type values that megatron-core's tokenizers build from local files.
NULL_TOKENIZER = "NullTokenizer"
FILE_TOKENIZERS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
}
TOKENIZERS = (NULL_TOKENIZER, *FILE_TOKENIZERS)
TOKENIZER_PACKAGES = {
    "GPT2BPETokenizer": "transformers",
    "HuggingFaceTokenizer": "transformers",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-zb train",
        description="Train a GPT with megatron-core and a megatron-zb schedule (Megatron-LM's pretrain_gpt flags).",
    )
    _model_args(parser)
    _parallel_args(parser)
    _training_args(parser)
    _data_args(parser)
    _run_args(parser)
    add_args(parser)
    return parser


def _model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (Megatron-LM names)")
    group.add_argument("--num-layers", type=int, required=True)
    group.add_argument("--hidden-size", type=int, required=True)
    group.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="default: 4 x --hidden-size (see --swiglu for its default)"
    )
    group.add_argument("--num-attention-heads", type=int, required=True)
    group.add_argument("--seq-length", type=int, required=True)
    group.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's vocabulary (megatron-core 0.16 adds one id, its end of document; 0.17 on does not); "
        "with --mock-data and no --tokenizer-type, the model's vocabulary before padding",
    )
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument(
        "--position-embedding-type", choices=("learned_absolute", "rope", "none"), default="learned_absolute"
    )
    _architecture_args(group)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--num-experts", type=int, default=None, help="refused: MoE is not supported yet")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--loss-scale", type=float, default=None, help="fp16: static loss scale (default dynamic)")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    group.add_argument("--min-loss-scale", type=float, default=1.0)
    group.add_argument(
        "--loss-scale-window", type=float, default=1000, help="fp16: steps without inf/nan before the scale doubles"
    )
    group.add_argument(
        "--hysteresis", type=int, default=2, help="fp16: inf/nan steps tolerated before the scale halves"
    )


def _architecture_args(group) -> None:
    """The Llama-family switches, under Megatron-LM's names, destinations, types and defaults."""
    group.add_argument(
        "--swiglu",
        action="store_true",
        help="gated linear units with SiLU in the MLP; --ffn-hidden-size then defaults to Megatron-LM's "
        "int(8 x hidden / 3 / 64) x 64",
    )
    group.add_argument("--normalization", type=str, choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    group.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    group.add_argument(
        "--apply-layernorm-1p",
        dest="layernorm_zero_centered_gamma",
        action="store_true",
        help="norm weights centred on 0 (GPUs: LayerNorm with NVIDIA apex only; --cpu: LayerNorm and RMSNorm)",
    )
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument(
        "--num-query-groups", type=int, default=1, help="with --group-query-attention: the key/value heads"
    )
    group.add_argument("--kv-channels", type=int, default=None, help="channels per head; default: hidden / heads")
    group.add_argument(
        "--disable-bias-linear", dest="add_bias_linear", action="store_false", help="no biases in any linear layer"
    )
    group.add_argument("--add-qkv-bias", action="store_true", help="with --disable-bias-linear: biases on QKV only")
    group.add_argument("--qk-layernorm", action="store_true", help="--normalization on each head's queries and keys")
    group.add_argument("--rotary-percent", type=float, default=1.0, help="rope: the fraction of head channels rotated")
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--use-rope-scaling", action="store_true", help="rope: Llama 3.x's frequency scaling")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0)


def _parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism (Megatron-LM names)")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    group.add_argument("--context-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--overlap-grad-reduce", action="store_true")
    group.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="ZeRO-3: shard parameters, gradients and optimizer state with PyTorch FSDP2; the schedule gathers and "
        "releases each chunk's weights and reduces its gradients where it plans them (megatron-zb schedules)",
    )
    group.add_argument("--distributed-backend", choices=("nccl", "gloo"), default="nccl")
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="timeout of every process group and collective; the watchdog names the stalled rank (default 10)",
    )


def _training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (Megatron-LM names)")
    group.add_argument("--micro-batch-size", type=int, required=True)
    group.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data parallel")
    group.add_argument("--train-iters", type=int, required=True)
    group.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    group.add_argument("--lr", type=float, required=True)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip; 0 turns it off")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--save", default=None, help="checkpoint directory")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    group.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="with --load: stop with an error when it holds no checkpoint, instead of training from scratch",
    )
    group.add_argument(
        "--exit-interval", type=int, default=None, help="stop after an iteration divisible by this (saving with --save)"
    )


def _data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data and evaluation (Megatron-LM names)")
    group.add_argument("--mock-data", action="store_true", help="synthetic learnable token sequences, no files")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="megatron-core indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: [WEIGHT] PREFIX ...",
    )
    group.add_argument("--split", default="969, 30, 1", help="train, validation, test proportions of --data-path")
    group.add_argument("--data-cache-path", default=None, help="where megatron-core keeps the dataset's indices")
    group.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    group.add_argument("--tokenizer-type", choices=TOKENIZERS, default=None, help="default: NullTokenizer semantics")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: its vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: its merges.txt")
    group.add_argument(
        "--tokenizer-model", default=None, help="SentencePiece, Llama2, TikTokenizer, HuggingFace: the model file"
    )
    group.add_argument("--eval-iters", type=int, default=100, help="iterations per evaluation; 0 turns it off")
    group.add_argument(
        "--eval-interval", type=int, default=1000, help="evaluate on the validation split every this many iterations"
    )


def _run_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launcher (megatron-zb)")
    group.add_argument(
        "--cpu",
        action="store_true",
        help="run on CPU: spawn --cpu-procs gloo processes here (no torchrun needed)",
    )
    group.add_argument("--cpu-procs", type=int, default=None, help="--cpu: processes (default: tensor x pipeline)")
    group.add_argument("--cpu-threads", type=int, default=1, help="--cpu: torch threads per process (default 1)")
    group.add_argument(
        "--megatron-lm",
        action="store_true",
        help="run Megatron-LM's pretrain() with these flags instead of this loop (needs a Megatron-LM checkout on "
        "PYTHONPATH or in MEGATRON_LM_PATH; real datasets, V schedules included)",
    )
    group.add_argument("--metrics-file", default=None, help="append one JSON line per iteration to this file")
    group.add_argument("--trace-file", default=None, help="write a Chrome/Perfetto trace of one iteration's passes")
    group.add_argument("--trace-iteration", type=int, default=None, help="iteration to trace (default: the last)")


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
    checks.check_zero3(args)
    checks.check_replan_window(args)
    check_before_spawn(args)  # --load/--save against the checkpoints there (manifest.py)
    checks.check_outputs(args)
    return checks.unused(args, given)


def _world_size(args: argparse.Namespace) -> int:
    import os

    if args.cpu:
        procs = args.cpu_procs or args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        if procs < 1:
            raise ValueError(f"--cpu-procs must be at least 1, got {procs}")
        return procs
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
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0 (0 turns evaluation off), got {args.eval_iters}")
    if args.eval_interval < 1:
        raise ValueError(f"--eval-interval must be at least 1, got {args.eval_interval}")


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
    if args.num_experts:
        raise ValueError("--num-experts: this launcher builds dense GPT models only; MoE is not supported yet")
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
