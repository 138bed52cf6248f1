"""MoE models through the launcher's own loop: every megatron-zb schedule trains them as megatron-core's schedule does.

Two tiny MoE lines, on CPU gloo ranks (``run_rank`` in a worker pool, as tests/training/test_launcher.py):

- Mixtral-style: 8 experts, top-2, the alltoall dispatcher, GShard's aux loss and the z-loss, token dropping
  (capacity factor 1.5), the router in fp32;
- DeepSeek-style: fine-grained experts (8 of FFN size 16), a gated shared expert, the first layer dense
  (``--moe-layer-freq``), the allgather dispatcher, the per-sequence aux loss, sigmoid routing with the expert bias
  that ``finalize_model_grads`` updates after each step.

Each trains at pp 2 with expert parallelism 1 (2 processes) and 2 (pp 2 x dp 2: 4 processes, each holding half the
experts) under megatron-core's own 1F1B (no schedule flag) and megatron-zb schedules: the loss and the grad norm of
every iteration must agree. At each expert-parallel size one run stops halfway with a checkpoint and resumes
exactly.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import build_parser, derive_and_check, parse

ITERATIONS, HALF = 10, 5
TOLERANCE = 1e-5  # relative; the passes run in another order, sums of the same terms may round differently
BASE = (
    "--cpu --num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--vocab-size 64 --mock-data --micro-batch-size 2 --lr 3e-3 --lr-warmup-iters 1 --hidden-dropout 0 "
    f"--attention-dropout 0 --log-interval {ITERATIONS} --seed 11 --pipeline-model-parallel-size 2 "
    "--disable-bias-linear --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights"
)
MIXTRAL = (
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-token-dispatcher-type alltoall "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
    "--moe-expert-capacity-factor 1.5 --moe-router-dtype fp32 --moe-grouped-gemm"
)
DEEPSEEK = (
    "--num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 32 "
    "--moe-shared-expert-gate --moe-layer-freq [0]+[1]*3 --moe-token-dispatcher-type allgather "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2"
)
MODELS = {"mixtral": MIXTRAL, "deepseek": DEEPSEEK}


def rank_rows(args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """On a pooled worker: this rank's training as the launcher runs it; iteration -> (loss, grad norm) where logged."""
    import torch

    from megatron_zb.pretrain_gpt import run_rank

    rows = run_rank(args, torch.device("cpu"), gloo=True)
    return {row["iteration"]: (row["loss"], row["grad_norm"]) for row in rows if row["loss"] is not None}


def rows_and_pairs(args: argparse.Namespace) -> tuple[dict[int, tuple[float, float]], int | None, str]:
    """On a pooled worker: ``rank_rows``, how many overlapped F&B pairs the re-planned schedule has (None: no
    re-plan happened) and what the re-plan said."""
    from megatron_zb.megatron.install import runner_for

    rows = rank_rows(args)
    report = runner_for(args.zero_bubble).replan_report
    replaced = report is not None and report.replaced
    return rows, (report.pairs if replaced else None), report.message() if report is not None else ""


def moe_layers(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """On a pooled worker: (global layer number, local experts, total experts) of this rank's MoE layers, as built."""
    import torch

    from megatron_zb.megatron.install import configure, install
    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.training.build import build, init_parallel

    install()
    configure(args.zero_bubble)
    init_parallel(args, torch.device("cpu"))
    try:
        trainee = build(args, torch.device("cpu"), gloo=True)
        found = []
        for chunk in trainee.chunks:
            for module in chunk.modules():
                if type(module).__name__ == "TransformerLayer" and hasattr(module.mlp, "experts"):
                    experts = module.mlp.experts.local_experts
                    found.append((module.layer_number, len(experts), module.mlp.config.num_moe_experts))
        return found
    finally:
        destroy_model_parallel()


def arguments(model: str, processes: int, extra: str) -> argparse.Namespace:
    batch = 4 * processes  # 8 microbatches per pipeline at dp 1, 4 at dp 2
    return parse(f"{BASE} {MODELS[model]} --cpu-procs {processes} --global-batch-size {batch} {extra}".split())


def train(pool: WorkerPool, model: str, extra: str) -> dict[int, tuple[float, float]]:
    found = [rows for rows in pool.run(rank_rows, args=arguments(model, pool.world_size, extra)) if rows]
    assert found and all(rows == found[0] for rows in found), "the logging ranks disagree"
    return found[0]


def assert_agree(runs: dict[str, dict[int, tuple[float, float]]], iterations: int = ITERATIONS) -> None:
    reference = runs["megatron-core"]
    assert sorted(reference) == list(range(1, iterations + 1))
    assert reference[iterations][0] < reference[1][0], "training must lower the loss"
    for name, rows in runs.items():
        assert sorted(rows) == sorted(reference), name
        for iteration, (loss, norm) in rows.items():
            theirs_loss, theirs_norm = reference[iteration]
            assert loss == pytest.approx(theirs_loss, rel=TOLERANCE), f"{name}: loss of iteration {iteration}"
            assert norm == pytest.approx(theirs_norm, rel=TOLERANCE), f"{name}: grad norm of iteration {iteration}"


@pytest.fixture(scope="module")
def pool2(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


# Beside zb-1p and zb-v: the automatic V, interleaved zero bubble (Mixtral), BitPipe's two pipes (each copy of a
# layer routes half the microbatches: the copies' gradients and expert-bias counts are summed) and, for DeepSeek,
# breadth-first with the B/W split.
INTERLEAVED = "zb-1p --virtual-pipeline-model-parallel-size 2"  # interleaved zero bubble: two chunks per rank
MORE = {"mixtral": ("v-auto", "bitpipe-zb", INTERLEAVED), "deepseek": ("v-auto", "bitpipe-zb", "breadth-first-zb")}


@pytest.mark.parametrize("model", list(MODELS))
def test_ep1_schedules_equal_megatron_cores_and_resume_exactly(pool2: WorkerPool, model: str, tmp_path: Path) -> None:
    """pp 2: megatron-core's 1F1B, zb-1p, zb-v and MORE; then zb-v halfway and resumed."""
    iterations = f"--train-iters {ITERATIONS}"
    runs = {"megatron-core": train(pool2, model, iterations)}
    for name in ("zb-1p", "zb-v", *MORE[model]):
        runs[name] = train(pool2, model, f"{iterations} --pipeline-schedule {name}")
    assert_agree(runs)
    saved = tmp_path / "checkpoints"
    first = train(pool2, model, f"{iterations} --pipeline-schedule zb-v --exit-interval {HALF} --save {saved}")
    resumed = train(pool2, model, f"{iterations} --pipeline-schedule zb-v --load {saved}")
    assert sorted(first) == list(range(1, HALF + 1)) and sorted(resumed) == list(range(HALF + 1, ITERATIONS + 1))
    assert resumed == {i: runs["zb-v"][i] for i in resumed}, "the resumed run differs from the uninterrupted one"


@pytest.fixture(scope="module")
def pool4(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


@pytest.mark.parametrize("model", list(MODELS))
def test_ep2_schedules_equal_megatron_cores(pool4: WorkerPool, model: str, tmp_path: Path) -> None:
    """pp 2 x dp 2 with --expert-model-parallel-size 2: each rank holds 4 of the 8 experts of every MoE layer.

    Then zb-v halfway and resumed: each ep rank's file holds its own experts, and the run continues exactly.
    """
    extra = f"--train-iters {ITERATIONS} --expert-model-parallel-size 2"
    built = pool4.run(moe_layers, args=arguments(model, 4, extra + " --pipeline-schedule zb-v"))
    first = 2 if model == "deepseek" else 1  # DeepSeek's first layer is dense
    assert sorted({layer for rank in built for layer, _, _ in rank}) == list(range(first, 5))
    assert all(local == 4 and total == 8 for rank in built for _, local, total in rank)
    runs = {"megatron-core": train(pool4, model, extra)}
    for name in ("zb-1p", "zb-2p", "zb-v"):
        runs[name] = train(pool4, model, f"{extra} --pipeline-schedule {name}")
    assert_agree(runs)
    saved = tmp_path / "checkpoints"
    first = train(pool4, model, f"{extra} --pipeline-schedule zb-v --exit-interval {HALF} --save {saved}")
    folder = saved / f"iter_{HALF:07d}"
    assert sorted(p.name for p in folder.glob("mp_rank_*")) == [
        f"mp_rank_00_{pp:03d}_{ep:03d}" for pp in (0, 1) for ep in (0, 1)
    ]
    resumed = train(pool4, model, f"{extra} --pipeline-schedule zb-v --load {saved}")
    assert sorted(first) == list(range(1, HALF + 1)) and sorted(resumed) == list(range(HALF + 1, ITERATIONS + 1))
    assert resumed == {i: runs["zb-v"][i] for i in resumed}, "the resumed run differs from the uninterrupted one"


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_ep2_with_two_copies_of_each_expert_resumes_exactly(pool4: WorkerPool, optimizer: str, tmp_path: Path) -> None:
    """pp 1 x dp 4 at ep 2: each half of the experts sits on two ranks (expert dp 2), whose RNG states (plain) or
    optimizer shards (distributed) differ; the ranks of one ep rank share its file (plain) or write one each."""
    extra = f"--train-iters {ITERATIONS} --expert-model-parallel-size 2 --pipeline-model-parallel-size 1"
    extra += " --use-distributed-optimizer" if optimizer == "distributed" else ""
    uninterrupted = train(pool4, "mixtral", extra)
    saved = tmp_path / "checkpoints"
    first = train(pool4, "mixtral", f"{extra} --exit-interval {HALF} --save {saved}")
    files = sorted(p.parent.name for p in (saved / f"iter_{HALF:07d}").glob("mp_rank_*/*.pt"))
    copies = [f"_{copy:03d}" for copy in (0, 1)] if optimizer == "distributed" else [""]
    assert files == [f"mp_rank_00_000_{ep:03d}{copy}" for ep in (0, 1) for copy in copies]
    resumed = train(pool4, "mixtral", f"{extra} --load {saved}")
    assert sorted(first) == list(range(1, HALF + 1)) and sorted(resumed) == list(range(HALF + 1, ITERATIONS + 1))
    assert resumed == {i: uninterrupted[i] for i in resumed}, "the resumed run differs from the uninterrupted one"


# Re-planned from iteration 3's measured costs, with the all-to-all time: the pairs train as the passes in turn.
OVERLAP = (
    "--zero-bubble-overlap-f-b --zero-bubble-pipeline-timers-start-iter 2 --zero-bubble-pipeline-timers-end-iter 3"
)


def test_ep2_overlapped_pairs_equal_megatron_cores(pool4: WorkerPool) -> None:
    extra = f"--train-iters {ITERATIONS} --expert-model-parallel-size 2"
    runs = {"megatron-core": train(pool4, "mixtral", extra)}
    found = pool4.run(rows_and_pairs, args=arguments("mixtral", 4, f"{extra} --pipeline-schedule 1f1b {OVERLAP}"))
    rows = [rows for rows, _, _ in found if rows]
    pairs = {count for _, count, _ in found}
    assert len(pairs) == 1 and pairs.pop(), f"the re-plan placed no pairs: {found}"
    said = found[0][2]
    assert "overlapped F&B pairs" in said and re.search(r"iteration [\d.]+ -> [\d.]+ ms", said), said
    runs["1f1b with pairs"] = rows[0]
    assert_agree(runs)


def test_moe_flags_are_checked_before_anything_starts() -> None:
    line = f"{BASE} --cpu-procs 4 --global-batch-size 16 --train-iters 2"
    refusals = {
        "--num-experts 6 --expert-model-parallel-size 4": "--num-experts 6 does not divide by "
        "--expert-model-parallel-size 4",
        "--num-experts 8 --moe-router-topk 9": "--moe-router-topk 9 is above --num-experts 8",
        "--num-experts 8 --expert-model-parallel-size 4": "= 4 does not divide tensor (1) x data (2) parallel",
        "--num-experts 8 --moe-token-dispatcher-type flex": "flex needs DeepEP or HybridEP",
        "--num-experts 8 --moe-layer-freq [0]*4": "the pattern has no MoE layer",
        "--num-experts 8 --moe-layer-freq [1]*3": "one 0 (dense) or 1 (MoE) per layer, 4 in all",
        "--expert-model-parallel-size 2": "--expert-model-parallel-size 2 needs --num-experts",
        "--cpu-procs 8 --num-experts 8 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --save ckpt": (
            "--save with --expert-model-parallel-size 2 needs --expert-tensor-parallel-size equal to "
            "--tensor-model-parallel-size"
        ),
        "--num-experts 8 --moe-router-enable-expert-bias": "needs --moe-router-score-function sigmoid",
        f"{MIXTRAL.replace('aux_loss', 'global_aux_loss')} --pipeline-schedule bitpipe-zb": "bitpipe-zb with "
        "--moe-router-load-balancing-type global_aux_loss: the schedule keeps two copies",
        "--num-experts 8 --zero-bubble-overlap-f-b --enable-zero-bubble": "needs --num-experts and "
        "--expert-model-parallel-size of 2 or more",
        "--num-experts 8 --expert-model-parallel-size 2 --zero-bubble-overlap-f-b": "applies to megatron-zb "
        "schedules only",
        "--num-experts 8 --expert-model-parallel-size 2 --zero-bubble-overlap-f-b --enable-zero-bubble "
        "--no-zero-bubble-replan": "which --no-zero-bubble-replan turns off",
        "--num-experts 8 --expert-model-parallel-size 2 --zero-bubble-overlap-f-b --enable-zero-bubble "
        "--enable-optimizer-post-validation": "--zero-bubble-overlap-f-b with --enable-optimizer-post-validation",
    }
    for flags, message in refusals.items():
        with pytest.raises(ValueError) as refused:
            derive_and_check(build_parser().parse_args(f"{line} {flags}".split()))
        assert message in str(refused.value), (flags, str(refused.value))


def test_moe_flags_reach_megatron_cores_config() -> None:
    from megatron_zb.training.build import transformer_config

    args = arguments("deepseek", 2, "--train-iters 2 --pipeline-schedule zb-v")
    config = transformer_config(args, gloo=True)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 3, 16)
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.moe_shared_expert_intermediate_size == 32
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("seq_aux_loss", 1e-2)
    assert config.moe_router_enable_expert_bias and config.moe_router_score_function == "sigmoid"
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (1, 1)
    mixtral = arguments("mixtral", 2, "--train-iters 2")
    config = transformer_config(mixtral, gloo=True)
    assert (config.moe_token_dispatcher_type, config.moe_expert_capacity_factor) == ("alltoall", 1.5)
    assert config.moe_router_dtype == "fp32" and config.moe_grouped_gemm is False  # sequential experts (see parse)
