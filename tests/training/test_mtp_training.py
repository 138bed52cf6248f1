"""Multi-token prediction (MTP) through the launcher's own loop: megatron-zb's schedules train it as megatron-core.

megatron-core builds the MTP block in the loss chunk, with a copy of the word embedding (it embeds the tokens
again). Under the looping placement (zb-1p) that chunk is on the last rank and megatron's embedding group keeps the
copy equal to the first rank's; under the V (zb-v) it is rank 0's second chunk, beside the embedding, and the two
local copies are tied by megatron-zb (their gradients summed). A tiny dense GPT and a tiny MoE model, each with one
MTP layer, train at pp 2 (two CPU gloo ranks) under megatron-core's 1F1B, zb-1p and zb-v: the loss, the MTP loss
and the grad norm of every iteration must agree. The MTP layer's linears go through the B/W split (deferred to W).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import build_parser, derive_and_check, parse

ITERATIONS = 6
TOLERANCE = 1e-5  # relative, as tests/training/test_moe_training.py: the passes run in another order
MTP_LAYERS, MTP_SCALE = 1, 0.3
BASE = (
    "--cpu --num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--vocab-size 64 --mock-data --micro-batch-size 2 --lr 3e-3 --lr-warmup-iters 1 --hidden-dropout 0 "
    f"--attention-dropout 0 --log-interval {ITERATIONS} --seed 11 --pipeline-model-parallel-size 2 "
    f"--cpu-procs 2 --global-batch-size 8 --train-iters {ITERATIONS} --normalization RMSNorm --swiglu "
    "--disable-bias-linear --position-embedding-type rope"
)
MODELS = {
    "dense": "",  # tied embeddings: under zb-1p the last rank's copy serves the output layer and MTP both
    "moe": "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 "
    "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2",
}


def arguments(model: str, extra: str, mtp: bool = True) -> argparse.Namespace:
    """The launcher's arguments, with MTP's flags when ``mtp``."""
    flags = f" --mtp-num-layers {MTP_LAYERS} --mtp-loss-scaling-factor {MTP_SCALE}" if mtp else ""
    return parse(f"{BASE} {MODELS[model]} {extra}{flags}".split())


def rank_rows(args: argparse.Namespace) -> dict[int, tuple[float, float, float]]:
    """On a pooled worker: iteration -> (loss, MTP loss, grad norm) of the logged iterations on this rank."""
    import torch

    from megatron_zb.pretrain_gpt import run_rank

    rows = run_rank(args, torch.device("cpu"), gloo=True)
    return {
        row["iteration"]: (row["loss"], (row["mtp_loss"] or [None])[0], row["grad_norm"]) for row in rows if row["loss"]
    }


def deferred_mtp_grads(args: argparse.Namespace) -> list[tuple[str, bool, bool]]:
    """On a pooled worker, zb-v's chunks: one microbatch's B with the W held back, then its W."""
    import torch

    from megatron_zb.megatron.install import configure, install
    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.training.build import build, init_parallel

    install()
    configure(args.zero_bubble)
    init_parallel(args, torch.device("cpu"))
    try:
        trainee = build(args, torch.device("cpu"), gloo=True)
        return _split_mtp_backward(trainee)
    finally:
        destroy_model_parallel()


def _split_mtp_backward(trainee) -> list[tuple[str, bool, bool]]:
    """(weight, any gradient after B, gradient after W equal to megatron-core's fused backward) per MTP linear."""
    import torch

    from megatron_zb.runtime import linear_split
    from megatron_zb.runtime.wgrad import WeightGradStore

    linear_split.install()  # as the executor does before its passes
    found = []
    for chunk in trainee.chunks:
        model = chunk.module
        if not getattr(model, "mtp_process", False):
            continue
        torch.manual_seed(5)
        tokens, hidden = torch.randint(0, 64, (2, 16)), torch.randn(16, 2, 32)
        weights = {name: p for name, p in model.mtp.named_parameters() if name.endswith("weight") and p.dim() == 2}

        _loss(model, tokens, hidden).backward()  # megatron-core's own backward (no store): the weight gradients in B
        fused = {name: p.main_grad.clone() for name, p in weights.items()}
        chunk.zero_grad_buffer()
        store = WeightGradStore()
        with store.recording():  # the F pass, as the executor runs it
            loss = _loss(model, tokens, hidden)
        with store.deferring((0, 0)):  # the B pass
            loss.backward()
        after_b = {name: bool(p.main_grad.abs().sum() > 0) for name, p in weights.items()}
        store.run((0, 0))  # the W pass
        found += [(name, after_b[name], torch.equal(p.main_grad, fused[name])) for name, p in weights.items()]
    return found


def _loss(model, tokens, hidden):
    if not model.pre_process:
        model.set_input_tensor(hidden.clone().requires_grad_())
    return model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum()


def train(pool: WorkerPool, model: str, extra: str, mtp: bool = True) -> dict[int, tuple[float, float, float]]:
    found = [rows for rows in pool.run(rank_rows, args=arguments(model, extra, mtp)) if rows]
    assert found and all(rows == found[0] for rows in found), "the logging ranks disagree"
    return found[0]


@pytest.fixture(scope="module")
def pool2(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


# Megatron's looping placement (one and two chunks per rank) and the V.
SCHEDULES = ("zb-1p", "zb-2p", "zb-1p --virtual-pipeline-model-parallel-size 2", "zb-v")


@pytest.mark.parametrize("model", list(MODELS))
def test_schedules_train_mtp_as_megatron_core(pool2: WorkerPool, model: str) -> None:
    runs = {"megatron-core": train(pool2, model, "")}
    for name in SCHEDULES:
        runs[name] = train(pool2, model, f"--pipeline-schedule {name}")
    reference = runs["megatron-core"]
    without = train(pool2, model, "", mtp=False)
    assert without[1][0] == reference[1][0], "MTP leaves the first iteration's lm loss alone"
    assert without[1][2] != pytest.approx(reference[1][2], rel=1e-3), "the MTP loss reaches the gradients"
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS][0] < reference[1][0] and reference[ITERATIONS][1] < reference[1][1]
    assert all(mtp > 0 for _, mtp, _ in reference.values()), "the MTP loss is logged"
    for name, rows in runs.items():
        assert sorted(rows) == sorted(reference), name
        for iteration, values in rows.items():
            assert values == pytest.approx(reference[iteration], rel=TOLERANCE), f"{name}: iteration {iteration}"


def test_mtp_linears_are_deferred_to_w(pool2: WorkerPool) -> None:
    built = pool2.run(deferred_mtp_grads, args=arguments("dense", "--pipeline-schedule zb-v"))
    rank0, rank1 = built
    assert rank1 == [], "under the V the MTP block sits on rank 0, with the loss"
    names = [name for name, _, _ in rank0]
    inner = "mtp_model_layer" if any(".mtp_model_layer." in name for name in names) else "transformer_layer"  # 0.19
    layer = f"layers.0.{inner}."
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert sorted(names) == sorted(["layers.0.eh_proj.weight", *(f"{layer}{linear}.weight" for linear in linears)])
    assert all(not after_b and exact for _, after_b, exact in rank0), rank0


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--pipeline-schedule bitpipe-zb", "--pipeline-schedule bitpipe-zb runs 2 pipes, each with its own copy"),
        ("--position-embedding-type learned_absolute", "use --position-embedding-type rope or none"),
    ],
)
def test_mtp_refusals_come_before_anything_starts(extra: str, message: str) -> None:
    args = build_parser().parse_args(f"{BASE} {extra}".split())
    args.mtp_num_layers, args.mtp_loss_scaling_factor = MTP_LAYERS, MTP_SCALE
    with pytest.raises(ValueError) as refused:
        derive_and_check(args)
    assert message in str(refused.value)
