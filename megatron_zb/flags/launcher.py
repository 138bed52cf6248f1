"""The launcher's flags: the subset of Megatron-LM's pretrain_gpt flags that megatron-zb train implements, and its own.

Megatron-LM's flags keep Megatron-LM's names, destinations, types and defaults (``differs`` says where one
departs from it on purpose, and why; tests/training/test_flag_surface.py holds the rest to it). The last
group is the launcher's own (``LAUNCHER``): Megatron-LM's pretrain_gpt has none of them. Ranges are checked
after parsing (``checks.check_numbers``), so that a refusal reads the same on every route.
"""

from __future__ import annotations

from dataclasses import replace

from .table import (
    COUNT,
    LAUNCHER,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    TIMEOUT_MINUTES,
    Flag,
    OnCpu,
    Range,
)

# Megatron-LM's --tokenizer-type values that megatron-core's tokenizers build (NullTokenizer: from no file).
TOKENIZERS = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
              "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")  # fmt: skip
SEED_RANGE = Range(0, 2**32, high_open=True)  # numpy's seed range, which Megatron-LM's _set_random_seed uses
LAUNCHER_GROUP = "launcher (megatron-zb)"
# What --use-torch-fsdp2 (ZeRO-3) is not verified with: the flags' fields, and why.
FSDP2_EXCLUDES = (
    ("use_distributed_optimizer", "ZeRO-3 already shards the optimizer state (that optimizer is ZeRO-1/2)"),
    ("overlap_grad_reduce", "the schedule starts each chunk's gradient reduction itself"),
    ("fp16", "ZeRO-3 is verified in fp32 only so far"),
    ("bf16", "ZeRO-3 is verified in fp32 only so far"),
    ("sequence_parallel", "ZeRO-3 is verified without tensor parallelism so far"),
)


def _group(title: str, *rows: Flag) -> tuple[Flag, ...]:
    return tuple(replace(row, group=title) for row in rows)


MODEL = _group(
    "model (Megatron-LM names)",
    Flag("--num-layers", type=int, required=True, range=COUNT),
    Flag("--hidden-size", type=int, required=True, range=COUNT),
    Flag("--ffn-hidden-size", "default: 4 x --hidden-size (see --swiglu for its default)", type=int, range=COUNT),
    Flag("--num-attention-heads", type=int, required=True, range=COUNT),
    Flag("--seq-length", type=int, required=True, range=COUNT,
         verify="a short sequence: the schedule does not depend on its length"),
    Flag("--max-position-embeddings", "default: --seq-length", type=int, range=COUNT,
         verify="the scaled sequence length"),
    Flag("--vocab-size", "NullTokenizer's vocabulary (megatron-core 0.16 adds one id, its end of document; 0.17 on "
         "does not); with --mock-data and no --tokenizer-type, the model's vocabulary before padding", type=int,
         range=COUNT, verify="a small vocabulary"),
    Flag("--make-vocab-size-divisible-by", type=int, default=128, range=COUNT),
    Flag("--untie-embeddings-and-output-weights", switch=True),
    Flag("--position-embedding-type", choices=("learned_absolute", "rope", "none"), default="learned_absolute"),
    # the Llama-family switches
    Flag("--swiglu", "gated linear units with SiLU in the MLP; --ffn-hidden-size then defaults to Megatron-LM's "
         "int(8 x hidden / 3 / 64) x 64", switch=True),
    Flag("--normalization", type=str, choices=("LayerNorm", "RMSNorm"), default="LayerNorm"),
    Flag("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5, range=NON_NEGATIVE),
    Flag("--apply-layernorm-1p", "norm weights centred on 0 (GPUs: LayerNorm with NVIDIA apex only; --cpu: LayerNorm "
         "and RMSNorm)", dest="layernorm_zero_centered_gamma", switch=True),
    Flag("--group-query-attention", switch=True),
    Flag("--num-query-groups", "with --group-query-attention: the key/value heads", type=int, default=1, range=COUNT,
         why="key/value heads"),
    Flag("--kv-channels", "channels per head; default: hidden / heads", type=int, range=COUNT,
         why="channels per attention head", verify="head size {value}"),
    Flag("--disable-bias-linear", "no biases in any linear layer", dest="add_bias_linear", switch=True, default=True),
    Flag("--add-qkv-bias", "with --disable-bias-linear: biases on QKV only", switch=True),
    Flag("--qk-layernorm", "--normalization on each head's queries and keys", switch=True),
    Flag("--rotary-percent", "rope: the fraction of head channels rotated", type=float, default=1.0,
         range=Range(0, 1, low_open=True), why="the fraction of each head's channels RoPE rotates"),
    Flag("--rotary-base", type=int, default=10000, range=COUNT, why="RoPE's wavelength base; Llama 3 uses 500000"),
    Flag("--use-rope-scaling", "rope: Llama 3.x's frequency scaling", switch=True),
    Flag("--rope-scaling-factor", type=float, default=8.0, range=POSITIVE),
    Flag("--mtp-num-layers", "multi-token prediction layers after the last (DeepSeek-V3); none: no MTP", type=int,
         range=COUNT),
    Flag("--mtp-loss-scaling-factor", "the MTP loss's weight in the training loss", type=float, default=0.1,
         range=NON_NEGATIVE),
    # initialisation, dropout, precision
    Flag("--init-method-std", type=float, default=0.02, range=NON_NEGATIVE),
    Flag("--hidden-dropout", type=float, default=0.1, range=PROBABILITY, why="0 turns dropout off"),
    Flag("--attention-dropout", type=float, default=0.1, range=PROBABILITY, why="0 turns dropout off"),
    Flag("--fp16", switch=True),
    Flag("--bf16", switch=True),
    Flag("--loss-scale", "fp16: static loss scale (default dynamic)", type=float, range=POSITIVE,
         why="leave it out for the dynamic scale"),
    Flag("--initial-loss-scale", type=float, default=2.0**32, range=POSITIVE,
         verify="at a larger scale the few scaled iterations would all overflow and skip their step (a full-size run "
         "lowers the scale in its first steps); both runs start from it"),
    Flag("--min-loss-scale", type=float, default=1.0, range=POSITIVE),
    Flag("--loss-scale-window", "fp16: steps without inf/nan before the scale doubles", type=float, default=1000,
         range=Range(1)),
    Flag("--hysteresis", "fp16: inf/nan steps tolerated before the scale halves", type=int, default=2, range=COUNT),
)  # fmt: skip

PARALLELISM = _group(
    "parallelism (Megatron-LM names)",
    Flag("--tensor-model-parallel-size", type=int, default=1, range=COUNT),
    Flag("--pipeline-model-parallel-size", type=int, default=1, range=COUNT),
    Flag("--virtual-pipeline-model-parallel-size", "model chunks per pipeline rank (Megatron-LM's pretrain_gpt sets "
         "them with --num-layers-per-virtual-pipeline-stage only)", type=int, range=COUNT, honoured=LAUNCHER),
    Flag("--num-layers-per-virtual-pipeline-stage", type=int, range=COUNT, verify="one layer per pipeline block"),
    Flag("--context-parallel-size", type=int, default=1, range=COUNT),
    Flag("--expert-model-parallel-size", "MoE: ranks the experts are spread over (within tensor x data parallel)",
         type=int, default=1, range=COUNT, why="ranks sharing out the experts"),
    Flag("--expert-tensor-parallel-size", "MoE: tensor parallelism inside each expert (default: "
         "--tensor-model-parallel-size)", type=int, range=COUNT, why="ranks splitting each expert"),
    Flag("--sequence-parallel", switch=True),
    Flag("--use-distributed-optimizer", switch=True),
    Flag("--overlap-grad-reduce", switch=True),
    Flag("--use-torch-fsdp2", "ZeRO-3: shard parameters, gradients and optimizer state with PyTorch FSDP2; the "
         "schedule gathers and releases each chunk's weights and reduces its gradients where it plans them "
         "(megatron-zb schedules)", switch=True, honoured=LAUNCHER, excludes=FSDP2_EXCLUDES,
         verify="--use-torch-fsdp2: Megatron-LM runs torch FSDP2 without pipeline parallelism only, and a pipeline "
         "schedule needs a pipeline: there is no zero-bubble schedule to compare (megatron-zb's own ZeRO-3 with a "
         "pipeline: `megatron-zb train --use-torch-fsdp2 --pipeline-schedule breadth-first-zb`)"),
    Flag("--distributed-backend", choices=("nccl", "gloo"), default="nccl",
         on_cpu=OnCpu("gloo", "NCCL needs GPUs; gloo runs the same collectives on CPU")),
    Flag("--distributed-timeout-minutes", "timeout of every process group and collective; the watchdog names the "
         "stalled rank (default 10)", type=float, default=10, range=TIMEOUT_MINUTES,
         refusal="{option} must be a finite number of minutes from 1 second to a day ({range.low:.4g} to "
         "{range.high:g}), got {value}: it bounds every wait, and names the stalled rank once a wait reaches it",
         differs="takes fractions of a minute too (Megatron-LM: whole minutes)",
         verify="a stalled scaled run is named within {value} minutes (its steps take well under a second)"),
)  # fmt: skip

# Megatron-LM's --moe-router-load-balancing-type values that megatron-core 0.16 to 0.19 all build.
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
MOE = _group(
    "mixture of experts (Megatron-LM names)",
    Flag("--num-experts", "experts per MoE layer (0 or none: a dense model)", type=int, range=NON_NEGATIVE,
         why="0 or leave it out for a dense model"),
    Flag("--moe-layer-freq", "MoE layers among the decoder layers: N (every N-th layer, the first included) or a "
         "Python list pattern of 1 (MoE) and 0 (dense) per layer, e.g. \"[0]+[1]*3\"", default=1),
    Flag("--moe-ffn-hidden-size", "each expert's FFN size (default: --ffn-hidden-size)", type=int, range=COUNT),
    Flag("--moe-router-topk", "experts each token is routed to", type=int, default=2, range=COUNT,
         why="experts per token"),
    Flag("--moe-shared-expert-intermediate-size", "the shared experts' total FFN size (none: no shared expert)",
         type=int, range=COUNT),
    Flag("--moe-shared-expert-gate", "a sigmoid gate on the shared experts' output", switch=True),
    Flag("--moe-router-load-balancing-type", "aux_loss (GShard), seq_aux_loss (DeepSeek-V2, per sequence), "
         "global_aux_loss, sinkhorn or none; several with matching --moe-aux-loss-coeff values", nargs="+",
         type=str, choices=LOAD_BALANCING, default="aux_loss"),
    Flag("--moe-aux-loss-coeff", "the load-balancing loss's coefficient(s) (1e-2 is a usual start)", type=float,
         nargs="+", default=0.0),
    Flag("--moe-z-loss-coeff", "the router z-loss's coefficient (1e-3 is a usual start)", type=float,
         range=NON_NEGATIVE),
    Flag("--moe-router-score-function", choices=("softmax", "sigmoid"), type=str, default="softmax"),
    Flag("--moe-router-pre-softmax", "softmax (sigmoid) before the top-k choice", switch=True),
    Flag("--moe-router-topk-scaling-factor", "with --moe-router-pre-softmax: scales the chosen scores", type=float,
         range=POSITIVE),
    Flag("--moe-router-num-groups", "group-limited routing (DeepSeek-V3): expert groups", type=int, range=COUNT),
    Flag("--moe-router-group-topk", "group-limited routing: groups each token may choose from", type=int,
         range=COUNT),
    Flag("--moe-router-enable-expert-bias", "aux-loss-free balancing: a per-expert routing bias updated after each "
         "step (needs --moe-router-score-function sigmoid)", switch=True),
    Flag("--moe-router-bias-update-rate", type=float, default=1e-3, range=NON_NEGATIVE),
    Flag("--moe-router-dtype", "the router's and the expert-output averaging's dtype (default: the model's)",
         type=str, choices=("fp32", "fp64")),
    Flag("--moe-token-dispatcher-type", "allgather or alltoall (flex needs DeepEP or HybridEP on GPUs: refused)",
         type=str, choices=("allgather", "alltoall", "flex"), default="allgather"),
    Flag("--moe-grouped-gemm", "taken, and said: the launcher builds megatron-core's local layers, whose experts run "
         "one after the other (SequentialMLP, the same math; grouped GEMM needs Transformer Engine: --megatron-lm)",
         switch=True, differs="the launcher's experts are always SequentialMLP (a printed line says so)"),
    Flag("--moe-expert-capacity-factor", "token dropping: each expert takes at most this x its even share of tokens "
         "(none: no dropping)", type=float, range=POSITIVE, why="leave it out to drop no tokens"),
    Flag("--moe-pad-expert-input-to-capacity", "with a capacity factor: pad each expert's input to its capacity",
         switch=True),
    Flag("--moe-token-drop-policy", "with a capacity factor: drop the lowest-probability tokens (probs) or the last "
         "ones (position)", type=str, choices=("probs", "position"), default="probs"),
)  # fmt: skip

TRAINING = _group(
    "training (Megatron-LM names)",
    Flag("--micro-batch-size", type=int, required=True, range=COUNT, why="samples per microbatch",
         verify="a small microbatch"),
    Flag("--global-batch-size", "default: micro batch x data parallel", type=int, range=COUNT,
         why="or leave it out for micro batch x data parallel"),
    Flag("--train-iters", type=int, required=True, range=COUNT, why="iterations to train",
         verify="verify trains {value} iterations (--verify-iters)"),
    Flag("--optimizer", choices=("adam", "sgd"), default="adam"),
    Flag("--lr", type=float, required=True, range=NON_NEGATIVE, why="0 keeps the weights fixed"),
    Flag("--min-lr", type=float, default=0.0, range=NON_NEGATIVE),
    Flag("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear"),
    Flag("--lr-decay-iters", "default: --train-iters", type=int, range=COUNT, verify="decays over the scaled run"),
    Flag("--lr-warmup-iters", type=int, default=0, range=NON_NEGATIVE),
    Flag("--weight-decay", type=float, default=0.01, range=NON_NEGATIVE),
    Flag("--adam-beta1", type=float, default=0.9, range=PROBABILITY),
    Flag("--adam-beta2", type=float, default=0.999, range=PROBABILITY),
    Flag("--adam-eps", type=float, default=1e-8, range=NON_NEGATIVE),
    Flag("--clip-grad", "global grad-norm clip; 0 turns it off", type=float, default=1.0, range=NON_NEGATIVE,
         why="0 turns clipping off"),
    Flag("--seed", type=int, default=1234, range=SEED_RANGE),
    Flag("--log-interval", type=int, default=100, range=COUNT, why="iterations between log lines",
         verify="verify reads every iteration's loss and grad norm"),
    Flag("--save", "checkpoint directory",
         verify="saved once, at the end, in verify's temporary folder (checks the save path, never writes into "
         "yours); megatron-core's run saves nothing"),
    Flag("--save-interval", type=int, range=COUNT,
         why="iterations between checkpoints; leave it out to save only at the end", verify="saves once, at the end"),
    Flag("--load", "resume from the latest checkpoint in this directory",
         verify="a checkpoint of the full-size model does not fit the scaled copy; both runs start from the seed"),
    Flag("--exit-on-missing-checkpoint", "with --load: stop with an error when it holds no checkpoint, instead of "
         "training from scratch", switch=True),
    Flag("--exit-interval", "stop after an iteration divisible by this (saving with --save)", type=int, range=COUNT,
         why="leave it out to train all --train-iters", verify="the scaled copy runs all its iterations"),
)  # fmt: skip

DATA = _group(
    "data and evaluation (Megatron-LM names)",
    Flag("--mock-data", "synthetic learnable token sequences, no files", switch=True),
    Flag("--data-path", "megatron-core indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: [WEIGHT] "
         "PREFIX ...", nargs="*"),
    Flag("--split", "train, validation, test proportions of --data-path", default="969, 30, 1",
         differs="default '969, 30, 1', what Megatron-LM's validate_args fills in for None"),
    Flag("--data-cache-path", "where megatron-core keeps the dataset's indices",
         verify="verify writes only in its temporary folder"),
    Flag("--eod-mask-loss", "no loss on end-of-document tokens", switch=True),
    Flag("--tokenizer-type", "default: NullTokenizer semantics", choices=TOKENIZERS,
         verify="mock data's tokenizer: ids 0 .. vocab size"),
    Flag("--vocab-file", "GPT2BPETokenizer: its vocab.json"),
    Flag("--merge-file", "GPT2BPETokenizer: its merges.txt"),
    Flag("--tokenizer-model", "SentencePiece, Llama2, TikTokenizer, HuggingFace: the model file"),
    Flag("--eval-iters", "iterations per evaluation; 0 turns it off", type=int, default=100, range=NON_NEGATIVE,
         why="0 turns evaluation off", verify="one evaluation batch: evaluation runs the schedule's forward-only path"),
    Flag("--eval-interval", "evaluate on the validation split every this many iterations", type=int, default=1000,
         range=COUNT, differs="default 1000: Megatron-LM's None fails in its own dataset builder (train_iters // None)",
         verify="evaluates once, at the end"),
)  # fmt: skip

OWN = _group(
    LAUNCHER_GROUP,
    Flag("--cpu", "run on CPU: spawn --cpu-procs gloo processes here (no torchrun needed)", switch=True),
    Flag("--cpu-procs", "--cpu: processes (default: tensor x pipeline)", type=int, range=COUNT,
         why="--cpu processes"),
    Flag("--cpu-threads", "--cpu: torch threads per process (default 1)", type=int, default=1, range=COUNT,
         why="torch threads per --cpu process"),
    Flag("--megatron-lm", "run Megatron-LM's pretrain() with these flags instead of this loop, from the checkout at "
         "PATH (or MEGATRON_LM_PATH, PYTHONPATH, or the megatron.training that megatron-core >= 0.17 ships; real "
         "datasets, V schedules included)", nargs="?", const="", metavar="PATH"),
    Flag("--metrics-file", "append one JSON line per iteration to this file"),
    Flag("--trace-file", "write a Chrome/Perfetto trace of one iteration's passes"),
    Flag("--trace-iteration", "iteration to trace (default: the last)", type=int, range=COUNT),
)  # fmt: skip
OWN = tuple(replace(row, honoured=LAUNCHER) for row in OWN)

# What the --megatron-lm launcher reads itself (megatron_lm/launch.py); Megatron-LM's parser reads the rest.
MEGATRON_LM_LAUNCHER = ("--megatron-lm", "--cpu", "--cpu-procs", "--cpu-threads", "--metrics-file")

# In the launcher's --help and docs/flags.md order.
LAUNCHER_FLAGS = (*MODEL, *MOE, *PARALLELISM, *TRAINING, *DATA, *OWN)
