"""Iteration time with and without optimizer post-validation, on CPU (pp=2, gloo, one thread per rank).

Two launcher-built GPTs (megatron-core DDP, get_megatron_optimizer, Adam, clip 1.0) train
with zb-2p side by side in blocks of iterations, alternating: one with megatron-core's
synchronous step, one post-validated. A block is timed from a barrier to a barrier and divided
by its iterations; the table gives the median per-iteration time of each and their ratio,
next to the simulator's period per iteration for the profiled costs (``simulate_iterations``).

    python scripts/bench_post_validation.py --output docs/bench_post_validation.md
"""

from __future__ import annotations

import argparse
import statistics
import time

MODEL = (
    "--cpu --cpu-procs 2 --pipeline-model-parallel-size 2 --num-layers {layers} --hidden-size {hidden} "
    "--num-attention-heads 8 --seq-length {seq} --vocab-size 1024 --mock-data --micro-batch-size 2 "
    "--global-batch-size {batch} --lr 1e-4 --clip-grad {clip} --hidden-dropout 0 --attention-dropout 0 "
    "--train-iters 1000 --pipeline-schedule {schedule} --untie-embeddings-and-output-weights"
)


def measure(argv: str, rounds: int, block: int) -> dict:
    """On every rank: alternate blocks of synchronous and post-validated iterations."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.training.arguments import parse
    from megatron_zb.training.build import build, init_parallel
    from megatron_zb.training.data import MockData
    from megatron_zb.training.gpt_step import forward_step

    device = torch.device("cpu")
    runs = {}
    args = None
    for name, extra in (("synchronous", ""), ("post-validation", " --enable-optimizer-post-validation")):
        args = parse((argv + extra).split())
        if not parallel_state.model_parallel_is_initialized():
            init_parallel(args, device)
        trainee = build(args, device, gloo=True)
        runs[name] = (trainee, ForwardBackward(args.zero_bubble.schedule))
    data = MockData(args.padded_vocab_size, args.seq_length, args.micro_batch_size, args.global_batch_size, 1, 0, 1)
    iteration = {"count": 0}

    def step(trainee, runner) -> None:
        iteration["count"] += 1
        for chunk in trainee.chunks:
            chunk.zero_grad_buffer()
        trainee.optimizer.zero_grad()
        runner(
            forward_step_func=forward_step,
            data_iterator=data.iterator(iteration["count"], device),
            model=trainee.chunks,
            num_microbatches=data.microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
        )
        succeeded, _, _ = trainee.optimizer.step()
        if succeeded:
            trainee.scheduler.step(increment=args.global_batch_size)

    times = {name: [] for name in runs}
    for index in range(rounds + 1):
        for name, (trainee, runner) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(block):
                step(trainee, runner)
            if trainee.validation is not None:
                trainee.validation.settle()
            dist.barrier()
            if index > 0:  # the first round warms up
                times[name].append((time.perf_counter() - start) / block)
    validation = runs["post-validation"][0].validation
    undone = sum(report.rolled_back for report in validation.reports)
    validation.close()
    return {"times": times, "undone": undone, "steps": len(validation.reports)}


def predicted(schedule: str, microbatches: int) -> tuple[float, float]:
    """The simulator's period per iteration (unit costs): synchronous, post-validated."""
    from megatron_zb.schedule import ScheduleSpec, build, simulate_iterations

    plan = build(schedule, ScheduleSpec(2, microbatches))
    sync = simulate_iterations(plan, iterations=4).period
    post = simulate_iterations(plan, iterations=4, post_validation=True).period
    return sync, post


def table(result: dict, argv: str, schedule: str, microbatches: int, rounds: int, block: int) -> str:
    sync = statistics.median(result["times"]["synchronous"])
    post = statistics.median(result["times"]["post-validation"])
    unit_sync, unit_post = predicted(schedule, microbatches)
    lines = [
        f"`{argv}`",
        "",
        f"{rounds} rounds of {block} iterations each, alternating; median per-iteration time. "
        f"Post-validation undid {result['undone']} of {result['steps']} steps on rank 0.",
        "",
        "| run | iteration (ms) | ratio | predicted ratio (unit costs) |",
        "|---|---|---|---|",
        f"| synchronous step | {sync * 1e3:.1f} | 1.000 | 1.000 |",
        f"| post-validation | {post * 1e3:.1f} | {post / sync:.3f} | {unit_post / unit_sync:.3f} |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zb-2p")
    parser.add_argument("--microbatches", "-m", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--output", help="also write the table to this markdown file")
    args = parser.parse_args()
    from megatron_zb.testing.bench import report, run_on_cpu_ranks

    argv = MODEL.format(
        layers=args.layers, hidden=args.hidden, seq=args.seq, batch=2 * args.microbatches, clip=args.clip,
        schedule=args.schedule,
    )  # fmt: skip
    results = run_on_cpu_ranks(2, measure, argv=argv, rounds=args.rounds, block=args.block)
    text = table(results[0], argv, args.schedule, args.microbatches, args.rounds, args.block)
    report(text, "Post-validation benchmark", "bench_post_validation.py", args.output)


if __name__ == "__main__":
    main()
