"""What re-planning from measured costs buys on CPU: unit-cost plans against re-planned ones (pp=2, gloo).

The stages of the toy GPT differ as in real models: the last holds the output layer and the
loss over a large vocabulary (``--vocab``), and ``--heavy-factor`` gives one layer block (of
rank 1) that many times the layers. Each schedule runs twice on the same chunks: as
planned at start with unit costs, and with a re-planning window in the warm-up (the runtime's
``ReplanWindow``, what ``--zero-bubble-pipeline-timers-*`` create). Both are then timed
round-robin; the table gives the measured ratio next to the simulator's, under the costs the
re-planning measured.

    python scripts/bench_replan.py --output docs/bench_replan.md
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEDULES = ("zb-1p", "zb-2p", "zb-v")


def measure(schedules: tuple[str, ...], pp: int, m: int, rounds: int, warmup: int, model: dict) -> dict:
    """On every rank: re-plan each schedule in its warm-up, then time unit-cost and re-planned runs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.replan import ReplanWindow
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=pp)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    toy = ToyGPT(**model)
    batches = toy.batches(m)

    def iteration(runner: ForwardBackward, chunks: list) -> float:
        for chunk in chunks:
            chunk.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        toy.step(runner, chunks, batches)
        dist.barrier()
        return time.perf_counter() - start

    runs, reports = {}, {}
    for name in schedules:
        unit = ForwardBackward(name)
        replanned = ForwardBackward(name, replan=ReplanWindow(warmup, warmup + 1))
        chunks = toy.chunks(toy.config(pp, unit.schedule_for(pp, m).chunks), unit.schedule_for(pp, m), rank)
        for _ in range(warmup + 1):
            iteration(unit, chunks)
            iteration(replanned, chunks)
        reports[name] = replanned.replan_report
        runs[name] = {"unit": (unit, chunks), "replanned": (replanned, chunks)}
    times = {(name, kind): [] for name in schedules for kind in ("unit", "replanned")}
    for _ in range(rounds):
        for name in schedules:
            for kind in ("unit", "replanned"):
                times[name, kind].append(iteration(*runs[name][kind]))
    return {"times": times, "reports": reports}


def table(result: dict, pp: int, m: int, model: dict, rounds: int, schedules: tuple[str, ...]) -> str:
    from megatron_zb.schedule import ScheduleSpec, build, simulate

    times = {key: statistics.median(values) for key, values in result["times"].items()}
    lines = [
        f"pp={pp}, m={m}, one compute thread per rank, gloo on CPU; model {model}; median of {rounds} "
        "iterations each, unit-cost and re-planned runs interleaved round-robin.",
        "",
        "| schedule | measured costs (ms per stage: T_F / T_B / T_W) | unit-cost plan (ms) | re-planned (ms) | "
        "measured ratio | predicted ratio | predicted bubble, unit → re-planned | replaced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in schedules:
        report = result["reports"][name]
        costs = report.costs
        chunks = build(name, ScheduleSpec(pp, m)).chunks
        unit = simulate(build(name, ScheduleSpec(pp, m)), costs).makespan
        best = simulate(build(name, ScheduleSpec(pp, m, chunks if chunks > 1 else None, costs)), costs).makespan
        predicted = best / unit if report.replaced else 1.0
        measured = times[name, "replanned"] / times[name, "unit"]
        lines.append(
            f"| {name} | {_ms(costs.t_f)} / {_ms(costs.t_b)} / {_ms(costs.t_w)} | {times[name, 'unit'] * 1e3:.1f} | "
            f"{times[name, 'replanned'] * 1e3:.1f} | {measured:.3f} | {predicted:.3f} | "
            f"{report.old_bubble:.1%} → {report.new_bubble:.1%} | {'yes' if report.replaced else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def _ms(values) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", "-m", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4, help="layers of a light block (chunk)")
    parser.add_argument("--heavy-factor", type=int, default=1, help="rank 1 block: times the layers")
    parser.add_argument("--vocab", type=int, default=16384, help="vocabulary of the embedding and the output layer")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--output", help="also write the table to this markdown file")
    args = parser.parse_args()
    from megatron_zb.testing.bench import report, run_on_cpu_ranks

    pp = 2
    model = dict(
        layers=args.layers,
        hidden=args.hidden,
        heads=8,
        seq=args.seq,
        micro_batch=2,
        vocab=args.vocab,
        heavy_block=1 if args.heavy_factor > 1 else None,
        heavy_factor=args.heavy_factor,
    )
    results = run_on_cpu_ranks(
        pp,
        measure,
        schedules=SCHEDULES,
        pp=pp,
        m=args.microbatches,
        rounds=args.rounds,
        warmup=args.warmup,
        model=model,
    )
    text = table(results[0], pp, args.microbatches, model, args.rounds, SCHEDULES)
    report(text, "Re-planning benchmark", "bench_replan.py", args.output)


if __name__ == "__main__":
    main()
