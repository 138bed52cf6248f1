"""The launcher trains the same model whatever the schedule, and resumes exactly from a checkpoint.

Every setting (pp=4, pp=2 x dp=2, pp=2 x tp=2) runs the launcher's per-rank entry point
(``run_rank``) inside one worker pool, so they pay the megatron-core import once; each trains
1f1b, zb-2p and zb-v for ITERATIONS iterations from one seed, then zb-v again stopping halfway with
a checkpoint and resuming; with data or tensor parallelism megatron-core's own 1F1B (no schedule
flag) must agree too. The real command, ``megatron-zb train --cpu`` (which spawns its own gloo
processes), runs once, and must give run_rank's losses bit for bit. A Llama-style flag set trains
alike under 1f1b, zb-1p, zb-2p, zb-v and megatron-core's own 1F1B at pp=2 and pp=4.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zb.testing.launcher import pool_losses as losses_in_pool
from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import parse

TOLERANCE = 1e-5
PP4 = "--pipeline-model-parallel-size 4 --global-batch-size 16"
SCHEDULES = ("1f1b", "zb-2p", "zb-v")
ITERATIONS, HALF = 4, 2
MODEL = (
    "--cpu --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data "
    f"--micro-batch-size 2 --train-iters {ITERATIONS} --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine "
    f"--min-lr 3e-4 --hidden-dropout 0 --attention-dropout 0 --log-interval {HALF} --seed 7"
)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check_runs(full: dict[str, dict[int, float]], first: dict[int, float], resumed: dict[int, float]) -> None:
    reference = full["1f1b"]
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS] < reference[1], "training must lower the loss"
    for name, losses in full.items():
        worst = max(relative(losses[i], reference[i]) for i in reference)
        assert worst <= TOLERANCE, f"{name}: loss differs from 1f1b's by {worst:.2e} relative"
    assert sorted(first) == list(range(1, HALF + 1))
    assert sorted(resumed) == list(range(HALF + 1, ITERATIONS + 1))
    assert all(resumed[i] == full["zb-v"][i] for i in resumed), (resumed, full["zb-v"])


def cli(flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_zb", "train", *MODEL.split(), *flags.split()]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def losses_of(path: Path) -> dict[int, float]:
    return {row["iteration"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def test_cli_refuses_before_starting_any_process() -> None:
    done = cli("--pipeline-model-parallel-size 4 --pipeline-schedule zb-v --num-layers 12")
    assert done.returncode == 2
    assert done.stderr.startswith("megatron-zb train: error: zb-v: --num-layers 12") and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def pool_losses(pool: WorkerPool, argv: str) -> dict[int, float]:
    return losses_in_pool(pool, parse((MODEL + " --cpu-procs 4 " + argv).split()))


@pytest.fixture(scope="module")
def pp4_zbv(pool: WorkerPool) -> dict[int, float]:
    """zb-v at pp=4 through ``run_rank`` in the pool: the losses the real command must reproduce."""
    return pool_losses(pool, f"{PP4} --pipeline-schedule zb-v")


def test_pp4_schedules_agree_and_resume_exactly(pool: WorkerPool, pp4_zbv: dict[int, float], tmp_path: Path) -> None:
    full = {name: pool_losses(pool, f"{PP4} --pipeline-schedule {name}") for name in SCHEDULES if name != "zb-v"}
    full["zb-v"] = pp4_zbv
    saved = tmp_path / "checkpoints"
    first = pool_losses(pool, f"{PP4} --pipeline-schedule zb-v --exit-interval {HALF} --save {saved}")
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == str(HALF)
    resumed = pool_losses(pool, f"{PP4} --pipeline-schedule zb-v --load {saved}")
    check_runs(full, first, resumed)


def test_the_real_command_trains_as_run_rank_does(pp4_zbv: dict[int, float], tmp_path: Path) -> None:
    """One end-to-end run of ``megatron-zb train --cpu`` (it spawns its own four gloo processes)."""
    metrics, trace = tmp_path / "zb-v.jsonl", tmp_path / "trace.json"
    done = cli(f"{PP4} --pipeline-schedule zb-v --metrics-file {metrics} --trace-file {trace}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"iteration {ITERATIONS:8d}/{ITERATIONS:8d}" in done.stdout and "measured bubble" in done.stdout
    assert losses_of(metrics) == pp4_zbv
    trace = json.loads(trace.read_text())
    assert trace["otherData"]["iterations"] == [ITERATIONS - 1, ITERATIONS]  # the traced iteration and the one before
    forwards = [
        event["tid"]
        for event in trace["traceEvents"]
        if event.get("ph") == "X" and event["cat"] == "F" and event["args"]["iteration"] == ITERATIONS
    ]
    assert sorted(set(forwards)) == [0, 1, 2, 3]  # one track per pipeline rank
    assert all(forwards.count(rank) == 16 for rank in range(4))  # two V chunks x 8 microbatches


@pytest.mark.parametrize(
    "setting",
    [
        "--pipeline-model-parallel-size 2 --global-batch-size 16 --use-distributed-optimizer --overlap-grad-reduce",
        "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --global-batch-size 8",
    ],
    ids=["pp2xdp2-distopt", "pp2xtp2"],
)
def test_pp2_with_data_or_tensor_parallel(pool: WorkerPool, setting: str, tmp_path: Path) -> None:
    full = {name: pool_losses(pool, f"{setting} --pipeline-schedule {name}") for name in SCHEDULES}
    full["megatron-core"] = pool_losses(pool, setting)  # no schedule flag: megatron-core's own 1F1B
    saved = tmp_path / "checkpoints"
    first = pool_losses(pool, f"{setting} --pipeline-schedule zb-v --exit-interval {HALF} --save {saved}")
    resumed = pool_losses(pool, f"{setting} --pipeline-schedule zb-v --load {saved}")
    check_runs(full, first, resumed)


def test_flags_replan_and_save_the_costs(pool: WorkerPool, tmp_path: Path) -> None:
    """The timer flags re-plan on every rank at the window's end; losses stay 1F1B's; the file plans offline."""
    from megatron_zb.cli import main as megatron_zb
    from megatron_zb.schedule import ScheduleSpec, build, simulate
    from megatron_zb.schedule.costs_file import load_costs

    setting = "--pipeline-model-parallel-size 2 --global-batch-size 16"
    costs, metrics = tmp_path / "costs.json", tmp_path / "zb-1p.jsonl"
    replan = (
        f"--zero-bubble-pipeline-timers-start-iter 2 --zero-bubble-pipeline-timers-end-iter 3 "
        f"--zero-bubble-save-costs {costs} --metrics-file {metrics}"
    )
    full = {
        "1f1b": pool_losses(pool, f"{setting} --pipeline-schedule 1f1b --no-zero-bubble-replan"),
        "zb-1p": pool_losses(pool, f"{setting} --pipeline-schedule zb-1p {replan}"),
    }
    worst = max(relative(full["zb-1p"][i], full["1f1b"][i]) for i in full["1f1b"])
    assert sorted(full["zb-1p"]) == list(range(1, ITERATIONS + 1)) and worst <= TOLERANCE, worst
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["iteration"] for row in rows if "replan" in row] == [3], "reported once, at the window's end"
    report = next(row["replan"] for row in rows if "replan" in row)
    saved = load_costs(costs)
    assert (saved.schedule, saved.microbatches, saved.iterations) == ("zb-1p", 4, (2, 3))  # data-parallel size 2
    assert min(saved.costs.t_f) > 0 and min(saved.costs.t_b) > 0 and min(saved.costs.t_w) > 0
    assert saved.extra["replan"] == report
    old = simulate(build("zb-1p", ScheduleSpec(2, 4)), saved.costs).bubble_rate
    assert report["old_bubble"] == pytest.approx(old)
    new = simulate(build("zb-1p", ScheduleSpec(2, 4, None, saved.costs)), saved.costs).bubble_rate
    assert report["new_bubble"] == pytest.approx(new if report["replaced"] else old)
    assert megatron_zb(["plan", "--costs-from", str(costs), "-o", str(tmp_path / "plan.txt")]) == 0
    assert "zb-1p" in (tmp_path / "plan.txt").read_text()


# Llama's architecture under Megatron-LM's flags: 4 query heads share 1 key/value head of 16 channels (hidden / heads
# would be 8); --swiglu's default --ffn-hidden-size is Megatron-LM's int(8 x 32 / 3 / 64) x 64 = 64.
LLAMA = (
    "--swiglu --normalization RMSNorm --norm-epsilon 1e-6 --group-query-attention --num-query-groups 1 "
    "--kv-channels 16 --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 4 --qk-layernorm"
)
LLAMA_TOLERANCE, LLAMA_ITERATIONS = 1e-6, 4
LLAMA_SCHEDULES = ("1f1b", "zb-1p", "zb-2p", "zb-v")


def test_llama_flags_reach_the_config_the_layer_spec_and_rope() -> None:
    import torch
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_zb.training.build import layer_spec, rotary_settings, transformer_config

    args = parse((MODEL + f" --pipeline-model-parallel-size 2 --pipeline-schedule zb-v {LLAMA}").split())
    config = transformer_config(args, gloo=True)
    silu = torch.nn.functional.silu
    assert (config.gated_linear_unit, config.activation_func, config.bias_activation_fusion) == (True, silu, False)
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (1, 16, 64)
    assert (config.normalization, config.layernorm_epsilon, config.qk_layernorm) == ("RMSNorm", 1e-6, True)
    assert (config.add_bias_linear, config.add_qkv_bias, config.layernorm_zero_centered_gamma) == (False, False, False)
    attention = layer_spec(args).submodules.self_attention.submodules
    assert attention.q_layernorm is not IdentityOp and attention.k_layernorm is not IdentityOp
    rope = {"rotary_percent": 1.0, "rotary_base": 500000, "rope_scaling": True, "rope_scaling_factor": 4.0}
    assert rotary_settings(args) == rope


@pytest.mark.parametrize("pp", [2, 4])
def test_llama_flags_train_alike_under_every_schedule(pool: WorkerPool, pp: int) -> None:
    """zb-1p gives megatron-core's own 1F1B (no schedule flag) bit for bit; zb-2p and zb-v give 1f1b's losses."""
    setting = f"--pipeline-model-parallel-size {pp} --global-batch-size 16 {LLAMA} --train-iters {LLAMA_ITERATIONS}"
    runs = {name: pool_losses(pool, f"{setting} --pipeline-schedule {name}") for name in LLAMA_SCHEDULES}
    runs["megatron-core"] = pool_losses(pool, setting)
    reference = runs["1f1b"]
    assert sorted(reference) == list(range(1, LLAMA_ITERATIONS + 1))
    assert reference[LLAMA_ITERATIONS] < reference[1], "training must lower the loss"
    assert runs["zb-1p"] == runs["megatron-core"], "zb-1p is not megatron-core's 1F1B bit for bit"
    for name, losses in runs.items():
        worst = max(relative(losses[i], reference[i]) for i in reference)
        assert worst <= LLAMA_TOLERANCE, f"{name}: loss differs from 1f1b's by {worst:.2e} relative"


def test_sequence_parallel_with_zero_centred_norms_trains_as_without_it(pool: WorkerPool) -> None:
    """On CPU, megatron_zb's torch norms take --apply-layernorm-1p and --sequence-parallel (megatron/norms.py).

    zb-v with sequence parallelism equals megatron-core's own 1F1B with it, and both equal the run without it:
    the norms' gradients are summed over the tensor-parallel group, and the W split gathers the sequence.
    """
    layernorm = LLAMA.replace("--normalization RMSNorm ", "").replace("--num-query-groups 1", "--num-query-groups 2")
    setting = (
        f"--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --global-batch-size 8 {layernorm} "
        f"--apply-layernorm-1p --train-iters {LLAMA_ITERATIONS}"
    )
    runs = {
        "zb-v, sequence parallel": pool_losses(pool, f"{setting} --sequence-parallel --pipeline-schedule zb-v"),
        "megatron-core, sequence parallel": pool_losses(pool, f"{setting} --sequence-parallel"),
        "zb-v": pool_losses(pool, f"{setting} --pipeline-schedule zb-v"),
    }
    reference = runs["zb-v"]
    assert reference[LLAMA_ITERATIONS] < reference[1], "training must lower the loss"
    for name, losses in runs.items():
        worst = max(relative(losses[i], reference[i]) for i in reference)
        assert worst <= LLAMA_TOLERANCE, f"{name}: loss differs from zb-v's without sequence parallelism by {worst:.2e}"
