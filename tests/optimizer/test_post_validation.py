"""Optimizer post-validation gives the synchronous optimizer's parameters and state, step for step.

Four gloo processes, one pool. Each case trains the launcher's GPT (megatron-core DDP and
get_megatron_optimizer) for STEPS steps three times from the same seed: with megatron-core's
synchronous step, with post-validation and exact rollback, and with in-place rollback. The
clip threshold is set so that clipping triggers on some steps and not on others, and one
step gets an inf gradient on one rank. After every step is validated, the main parameters,
the optimizer state, the loss scale and the LR schedule are compared with the synchronous
run's: bit for bit in exact mode, and in relative L2 norm (IN_PLACE) with in-place rollback.
"""

from __future__ import annotations

import pytest
import torch

from megatron_zb.render.chrome_trace import COLLECTIVES_TID
from megatron_zb.testing.pool import WorkerPool

STEPS = 14
# In place, a rolled-back step is redone within rounding (tests/optimizer/test_rollback.py), but the
# model amplifies the difference in the next steps' gradients, and Adam turns last-bit differences of
# near-zero gradients into whole updates: the runs drift apart, far more with bf16 model weights.
IN_PLACE = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 2e-3}  # one bf16 ulp of a parameter is 4e-3; fp16 measured 2.5e-4
CLIP = 1.2  # below the grad norm on some steps, above it on others
INF_STEP = 13  # late: the first stages' share of the norm is below CLIP, so they step on a guess
MODEL = (
    "--cpu --cpu-procs 4 --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
    "--mock-data --micro-batch-size 2 --lr 1e-2 --lr-warmup-iters 3 --lr-decay-style cosine --min-lr 1e-3 "
    f"--hidden-dropout 0 --attention-dropout 0 --seed 11 --weight-decay 0.1 --train-iters {STEPS}"
)


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def state_of(trainee) -> list[torch.Tensor]:
    """What a step changes: (main parameters, optimizer state, loss scale, LR schedule; the model's parameters)."""
    found = []
    for sub in trainee.optimizer.chained_optimizers:
        for group in sub.optimizer.param_groups:
            found.append(torch.tensor([group["lr"], group["weight_decay"]], dtype=torch.float64))
            for param in group["params"]:
                found.append(param.detach().clone())
                for key in sorted(sub.optimizer.state.get(param, {})):
                    found.append(torch.as_tensor(sub.optimizer.state[param][key]).detach().clone())
        scaler = getattr(sub, "grad_scaler", None)
        if scaler is not None:
            found.append(scaler.scale.detach().clone())
    found.append(torch.tensor([trainee.scheduler.num_steps], dtype=torch.float64))
    model = [param.detach().clone() for chunk in trainee.chunks for param in chunk.parameters()]
    return found, model  # the model's own copies: bf16, or the distributed optimizer's all-gather


def train(argv: str, inject_stage: int | None) -> dict:
    """STEPS steps on this rank; the state after each step once it is validated."""
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.training.arguments import parse
    from megatron_zb.training.build import build, init_parallel
    from megatron_zb.training.data import MockData
    from megatron_zb.training.gpt_step import forward_step

    args = parse(argv.split())
    device = torch.device("cpu")
    init_parallel(args, device)
    try:
        trainee = build(args, device, gloo=True)
        runner = ForwardBackward(args.zero_bubble.schedule, timeout_s=60, losses_to_last_rank=True)
        dp = parallel_state.get_data_parallel_world_size()
        data = MockData(
            args.padded_vocab_size, args.seq_length, args.micro_batch_size, args.global_batch_size, dp,
            parallel_state.get_data_parallel_rank(), args.seed,
        )  # fmt: skip
        stage = parallel_state.get_pipeline_model_parallel_rank()
        states, returned = [], []
        validation = trainee.validation
        for step in range(1, STEPS + 1):
            for chunk in trainee.chunks:
                chunk.zero_grad_buffer()
            trainee.optimizer.zero_grad()
            iterators = [data.iterator(step, device) for _ in trainee.chunks]
            runner(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=trainee.chunks,
                num_microbatches=data.microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
            )
            if validation is not None and step > 1:
                states.append(state_of(trainee))  # step - 1, validated before this iteration's first B
            if step == INF_STEP and stage == inject_stage:  # every replica: whichever holds the shard sees it
                param = next(p for p in trainee.chunks[0].parameters() if p.requires_grad)
                param.main_grad.view(-1)[0] = float("inf")
            succeeded, grad_norm, _ = trainee.optimizer.step()
            returned.append((succeeded, grad_norm, float(trainee.optimizer.get_loss_scale())))
            if succeeded:
                trainee.scheduler.step(increment=args.global_batch_size)
            if validation is None:
                states.append(state_of(trainee))
        if validation is not None:
            validation.close()
            states.append(state_of(trainee))
        reports = [] if validation is None else [vars(report) for report in validation.reports]
        return {"states": states, "returned": returned, "reports": reports, "redone": runner.redone_prefixes}
    finally:
        from megatron_zb.process_groups import destroy_model_parallel

        destroy_model_parallel()


def relative_l2(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """||ours - theirs|| / ||theirs|| over everything a step changes on this rank."""
    difference = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(ours, theirs, strict=True))
    size = sum(float(b.double().pow(2).sum()) for b in theirs)
    return (difference / size) ** 0.5


def compare_modes(setting: str, inject_stage: int | None) -> dict:
    """On every rank: train synchronously, then post-validated in both modes; compare states in place.

    Tensors stay in the worker (the pool returns only numbers): per mode and step, whether the
    state is bit-identical to the synchronous one and its worst relative difference.
    """
    base = f"{MODEL} {setting}"
    sync = train(base, inject_stage)
    found = {"returned": sync["returned"]}
    for mode in ("exact", "in-place"):
        run = train(
            f"{base} --enable-optimizer-post-validation --optimizer-post-validation-rollback {mode}", inject_stage
        )
        assert len(run["states"]) == len(sync["states"]) == STEPS
        pairs = [(sum(ours, []), sum(theirs, [])) for ours, theirs in zip(run["states"], sync["states"], strict=True)]
        main = [(ours[0], theirs[0]) for ours, theirs in zip(run["states"], sync["states"], strict=True)]
        found[mode] = {
            "identical": [all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)) for ours, theirs in pairs],
            "relative": [relative_l2(ours, theirs) for ours, theirs in main],
            "reports": run["reports"],
            "redone": run["redone"],
        }
    return found


def check(results: list[dict], expect_skip: bool, precision: str) -> dict:
    """Bit-identical in exact mode, close in place, on every rank and after every step."""
    for rank, result in enumerate(results):
        for step, (same, worst) in enumerate(
            zip(result["exact"]["identical"], result["exact"]["relative"], strict=True), start=1
        ):
            assert same, f"rank {rank}, step {step}: exact rollback differs by {worst:.3g} relative"
        for step, worst in enumerate(result["in-place"]["relative"], start=1):
            assert worst <= IN_PLACE[precision], (
                f"rank {rank}, step {step}: in-place rollback differs by {worst:.3g} relative"
            )
    skipped = {step for step, (ok, _, _) in enumerate(results[-1]["returned"], start=1) if not ok}
    assert skipped == ({INF_STEP} if expect_skip else set()), skipped
    for mode in ("exact", "in-place"):
        for rank, result in enumerate(results):
            validated = {report["step"] for report in result[mode]["reports"] if report["skipped"]}
            assert validated == skipped, f"{mode}, rank {rank}: skipped {validated}, synchronous {skipped}"
    norms = [norm for ok, norm, _ in results[-1]["returned"] if ok]
    clipped = [norm for norm in norms if norm > CLIP]
    assert 0 < len(clipped) < len(norms), f"clipping should trigger on some steps only: {norms}"
    reports = [report for result in results for report in result["exact"]["reports"]]
    undone = [report for report in reports if report["rolled_back"]]
    assert any(not report["skipped"] for report in undone), "no step was redone with clipping after a guess"
    if expect_skip:
        assert any(report["skipped"] for report in undone), "the inf/nan step was not undone after a guess"
    return {
        "in_place_worst": max(max(result["in-place"]["relative"]) for result in results),
        "rolled_back": sum(report["rolled_back"] for report in reports),
        "recomputed": max(result["exact"]["redone"] for result in results),
    }


PP4 = f"--pipeline-model-parallel-size 4 --global-batch-size 16 --clip-grad {CLIP}"
# With two stages the first holds most of the norm: a higher threshold lets it guess, then be wrong, on some steps.
# The dynamic scaler doubles its scale every 4 clean steps and halves it at the injected inf (no
# hysteresis): the scale is part of the compared state, so a scaler updated differently fails. From 64 it
# reaches 512 by step 12; from 256 it reached 2048, and on an AMD EPYC host (fp16 on CPU rounds by the
# ISA) the first stages then overflowed by themselves at step 13: they skipped without guessing, and
# no stage was left to guess, and be undone, at the injected inf.
FP16_DYNAMIC = "--initial-loss-scale 64 --loss-scale-window 4 --hysteresis 1"
PP2_DISTOPT = "--pipeline-model-parallel-size 2 --global-batch-size 16 --clip-grad 1.5 --use-distributed-optimizer"


@pytest.mark.parametrize(
    "setting, inject_stage, expect_skip",
    [
        (f"{PP4} --pipeline-schedule zb-2p", 2, False),  # FP32Optimizer: no grad scaler, nothing is ever skipped
        (f"{PP4} --pipeline-schedule zb-v --bf16 --loss-scale 1", 2, True),
        (f"{PP2_DISTOPT} --pipeline-schedule zb-2p --loss-scale 1", 1, True),
        (f"{PP2_DISTOPT} --pipeline-schedule zb-1p --bf16 --loss-scale 1", 1, True),
        (f"{PP4} --pipeline-schedule zb-1p --fp16 {FP16_DYNAMIC}", 2, True),
    ],
    ids=["pp4-fp32-zb2p", "pp4-bf16-zbv", "pp2xdp2-distopt-fp32", "pp2xdp2-distopt-bf16", "pp4-fp16-dynamic"],
)
def test_steps_match_the_synchronous_optimizer(pool: WorkerPool, setting: str, inject_stage, expect_skip) -> None:
    results = pool.run(compare_modes, setting=setting, inject_stage=inject_stage if expect_skip else None)
    precision = next((name for name in ("bf16", "fp16") if f"--{name}" in setting), "fp32")
    counts = check(results, expect_skip, precision)
    if precision == "fp16":  # the scaler did change: grown on clean windows, halved at the inf
        scales = [scale for _, _, scale in results[-1]["returned"]]
        assert max(scales) > 64 and scales[INF_STEP - 1] == scales[INF_STEP - 2] / 2, scales
    assert counts["rolled_back"] > 0, "no step was undone: the case does not exercise the rollback"
    assert counts["recomputed"] > 0, "no iteration prefix was redone"


def trace_run(argv: str) -> bool:
    import torch

    from megatron_zb.pretrain_gpt import run_rank
    from megatron_zb.training.arguments import parse

    run_rank(parse(argv.split()), torch.device("cpu"), gloo=True)
    return True


def between_iterations(trace: dict, first: int) -> dict[int, list[dict]]:
    """Per pipeline rank: the collectives between its last pass of ``first`` and its first F of ``first + 1``."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    found = {}
    for rank in sorted({e["tid"] for e in events if e["tid"] < COLLECTIVES_TID}):  # the planned actions' tracks aside
        mine = [e for e in events if e["tid"] == rank]
        passes = [e for e in mine if e["cat"] in ("F", "B", "W", "BW")]
        gap_start = max(e["ts"] + e["dur"] for e in passes if e["args"]["iteration"] == first)
        gap_end = min(e["ts"] for e in passes if e["args"]["iteration"] == first + 1 and e["cat"] == "F")
        found[rank] = [
            e for e in mine if e["cat"] == "collective" and e["ts"] < gap_end and e["ts"] + e["dur"] > gap_start
        ]
    return found


def test_trace_shows_no_cross_stage_collective_between_iterations(pool: WorkerPool, tmp_path) -> None:
    """With post-validation nothing spans stages between two iterations; megatron-core's step does (control)."""
    import json

    setting = (
        f"{MODEL} --pipeline-model-parallel-size 4 --global-batch-size 16 --pipeline-schedule zb-2p "
        "--untie-embeddings-and-output-weights --train-iters 6 --log-interval 10"
    )
    found = {}
    runs = {"synchronous": "", "post-validation": "--enable-optimizer-post-validation"}
    for name, extra in runs.items():
        path = tmp_path / f"{name}.json"
        pool.run(trace_run, argv=f"{setting} --trace-file {path} {extra}")
        trace = json.loads(path.read_text())
        assert trace["otherData"]["iterations"] == [5, 6]
        found[name] = between_iterations(trace, 5)
    crossing = {
        name: {rank: [e for e in events if e["args"]["cross_stage"]] for rank, events in per_rank.items()}
        for name, per_rank in found.items()
    }
    assert not any(crossing["post-validation"].values()), crossing["post-validation"]
    control = [e["name"] for events in crossing["synchronous"].values() for e in events]
    assert "all_reduce" in control, f"the synchronous step's grad-norm all-reduce is missing: {found['synchronous']}"
