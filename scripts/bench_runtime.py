"""Iteration time of megatron-core's own 1F1B against our schedules, on CPU (pp=2, gloo), and PyTorch's peer.

Two processes with one compute thread each run a small GPT for every schedule in turn
(round-robin, so drift hits all alike); the median iteration time is reported as a ratio to
megatron-core's 1F1B, next to the simulator's prediction from costs profiled in the same
run (T_F, T_B, T_W per stage and what the first and last block add, from a zb-v run: its
V has two blocks per stage; T_BW, the fused backward that prices 1F1B, from a 1f1b run; T_comm
from a ping-pong). The automatic schedules are planned
with those costs, as re-planning does in training. PyTorch's own pipelining runtime runs a
plain PyTorch GPT of the same sizes in the same rounds (``bench_runtime_pytorch.py``): its
schedules' ratio to its Schedule1F1B is the peer of ours to megatron-core's. The prediction is
also made with the costs measured in the timed rounds: on a shared CPU the passes' speed drifts
between profiling and timing by more than a zero-bubble gain, and that drift is the machine's, not the runtime's.

A second table splits each rank's time (``megatron_zb.training.idle``): compute (with the W
split's cost beyond 1F1B's fused backward), waits the plan had, waits it did not, send/recv
bookkeeping and Python between passes, each next to the simulated timeline's prediction. The
W split is measured against 1F1B's fused backward of the same block (its stage's share, the
ends' extras on the first and last block).

    python scripts/bench_runtime.py --output docs/bench_runtime.md

``--moe`` measures overlapped F&B pairs on an MoE model instead (``bench_runtime_moe.py``; its own page).

The workers keep freed memory (``megatron_zb.testing.bench``), for every schedule alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time

from bench_runtime_pytorch import PEERS, REFERENCE

# The page's own prose starts at this heading; a new run rewrites what is above it and keeps the rest.
NOTES = "## What the numbers say"
SCHEDULES = ("megatron-1f1b", "1f1b", "zb-h1", "zb-2p", "zb-v")
# The schedule whose passes (F, B and W apart) give the costs, before and during the timed rounds: a
# placement with two blocks per stage, so that the profile also says what the embedding and the loss add.
PROFILED = "zb-v"
# The schedule whose fused backward (a BW pass, B and W in one) gives the cost model's t_bw, which prices
# 1F1B: on this CPU it takes less than the split B + W of the same layers.
FUSED = "1f1b"
# Iterations profiled before the timed rounds: the ends' extras are differences of block times, noisier than these.
PROFILED_ITERATIONS = 6


def measure(
    schedules: tuple[str, ...], peers: tuple[str, ...], pp: int, m: int, rounds: int, warmup: int, model: dict
) -> dict:
    """On every rank: profile costs, plan every schedule with them, time them and PyTorch's ``peers`` round-robin."""
    import torch.distributed as dist
    from bench_runtime_pytorch import Peer, predicted
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=pp)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    toy = ToyGPT(**model)
    batches = toy.batches(m)
    models: dict[str, list] = {}  # placement kind -> this rank's chunks

    def chunks_for(runner: ForwardBackward) -> list:
        schedule = runner.schedule_for(pp, m)
        kind = schedule.placement.kind
        if kind not in models:
            models[kind] = toy.chunks(toy.config(pp, schedule.chunks), schedule, rank)
        return models[kind]

    def iteration(function, chunks: list | None) -> float:
        """One iteration of our runner or megatron-core's on ``chunks``; of a PyTorch peer's ``step`` without."""
        for chunk in chunks or ():
            chunk.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        if chunks is None:
            function()
        else:
            toy.step(function, chunks, batches)
        dist.barrier()
        return time.perf_counter() - start

    group = parallel_state.get_pipeline_model_parallel_group()
    shape = (toy.seq, toy.micro_batch, toy.hidden)

    # Both profiled in turn, iteration by iteration, so that the machine's drift does not set t_bw against t_b + t_w.
    profiling = [(profiler, ForwardBackward(name, profiler=profiler)) for name in (PROFILED, FUSED)
                 for profiler in [PassProfiler()]]  # fmt: skip
    for index in range(warmup + PROFILED_ITERATIONS):
        for profiler, runner in profiling:
            if index >= warmup:
                profiler.start()
            iteration(runner, chunks_for(runner))
            profiler.stop()
    split, fused = (profiler.cost_model(runner.schedule_for(pp, m), group, shape) for profiler, runner in profiling)
    costs = with_fused_backward(split, fused)

    runs, profilers, plans = {}, {}, {}
    for name in schedules:
        ours = name != "megatron-1f1b"
        profilers[name] = PassProfiler() if ours else None
        runner = ForwardBackward("1f1b" if not ours else name, costs=costs, profiler=profilers[name])
        function = runner if ours else forward_backward_pipelining_without_interleaving
        runs[name] = (function, chunks_for(runner))
        plans[name] = runner.schedule_for(pp, m)
    for label in peers:
        peer = Peer(label, pp, m, model, group)
        runs[label] = (peer.step, None)
    for _ in range(warmup):
        for name in (*schedules, *peers):
            iteration(*runs[name])
    times = {name: [] for name in (*schedules, *peers)}
    for index in range(rounds):
        for name in (*schedules, *peers):
            profiler = profilers.get(name)
            if profiler is not None:
                profiler.iteration = index
                profiler.start()
            times[name].append(iteration(*runs[name]))
            if profiler is not None:
                profiler.stop()
    # The same costs measured in the timed rounds: what the executed plans should have taken there.
    in_run = with_fused_backward(
        profilers[PROFILED].cost_model(plans[PROFILED], group, shape),
        profilers[FUSED].cost_model(plans[FUSED], group, shape),
    )
    # Each run's own passes as timed in the rounds (1F1B's fused backward, not B + W of the split passes);
    # megatron-core's 1F1B is not profiled: it runs our 1f1b's order and megatron-core's fused linears.
    own = {name: profilers[name].cost_model(plans[name], group, shape) for name in schedules if profilers[name]}
    own["megatron-1f1b"] = own["1f1b"]
    return {
        "times": times,
        "costs": costs,
        "in_run": in_run,
        "own": own,
        "plans": {name: plans[name] for name in schedules},
        "idle": idle_breakdowns(profilers, plans, in_run, rank, times),
        "peers": {"before": predicted(pp, m, costs), "in_run": predicted(pp, m, in_run)} if peers else None,
    }


def with_fused_backward(split, fused):
    """``split``'s costs with the fused BW time ``fused`` measured (``CostModel.t_bw``; its ends: B's plus W's)."""
    return dataclasses.replace(split, t_bw=fused.t_bw, t_bw_ends=None)


def idle_breakdowns(profilers: dict, plans: dict, costs, rank: int, times: dict) -> dict:
    """This rank's mean idle breakdown per profiled schedule, measured and predicted (seconds)."""
    from megatron_zb.schedule import simulate
    from megatron_zb.training import idle

    found = {}
    for name, profiler in profilers.items():
        if profiler is None:
            continue
        schedule = plans[name]
        timeline = simulate(schedule, costs)
        gaps = idle.planned_gaps(timeline, rank)
        measured = [
            dataclasses.replace(
                idle.measured(profiler.records, call, gaps),
                w_split=w_split(profiler.records, call, schedule, costs),
            )
            for call in profiler.calls
        ]
        outside = statistics.fmean(t - b.span for t, b in zip(times[name], measured, strict=True))
        found[name] = {
            "measured": idle.mean(measured),
            "predicted": idle.predicted(timeline, rank),
            "outside": outside,
        }
    return found


def w_split(records: list, call, schedule, costs) -> float:
    """One run's B and W passes minus the fused backward of their blocks (``costs.t_bw``, ends and all), seconds."""
    from megatron_zb.schedule import PassKind

    extra = 0.0
    for r in records:
        if r.iteration != call.iteration or r.pass_.kind not in (PassKind.B, PassKind.W):
            continue
        extra += r.end - r.start
        if r.pass_.kind is PassKind.B:
            fused = dataclasses.replace(r.pass_, kind=PassKind.BW)
            extra -= costs.duration(fused, schedule.placements[r.pass_.pipe])
    return extra


def predictions(plans: dict, costs) -> dict[str, tuple[float, float]]:
    """(makespan, bubble) the simulator predicts for each executed plan with ``costs``."""
    from megatron_zb.schedule import simulate

    found = {}
    for name, schedule in plans.items():
        timeline = simulate(schedule, costs)
        found[name] = (timeline.makespan, timeline.bubble_rate_makespan)
    return found


def ratio(times: dict, name: str, reference: str) -> float:
    """The median of each round's ratio to the same round's ``reference``: drift over minutes cancels."""
    return statistics.median(t / b for t, b in zip(times[name], times[reference], strict=True))


def median_interval(times: dict, name: str, reference: str, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median per-round ratio (order statistics; at least ``level``).

    The rounds' ratios scatter by a few percent on a shared CPU; the interval says how far the median
    could be from the machine's true ratio, and with it the gain kept.
    """
    ratios = sorted(t / b for t, b in zip(times[name], times[reference], strict=True))
    n, below = len(ratios), 0.0
    k = 0  # the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2
    while below + math.comb(n, k) / 2**n <= (1 - level) / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    return (ratios[k - 1], ratios[n - k]) if k else (ratios[0], ratios[-1])


def table(
    results: list[dict], pp: int, m: int, model: dict, rounds: int, schedules: tuple[str, ...], peers: tuple[str, ...]
) -> str:
    result = results[0]
    times = {name: statistics.median(values) for name, values in result["times"].items()}
    before = predictions(result["plans"], result["costs"])
    during = predictions(result["plans"], result["in_run"])
    own = {name: predictions({name: plan}, result["own"][name])[name] for name, plan in result["plans"].items()}
    lines = [
        f"pp={pp}, m={m}, one compute thread per rank, gloo on CPU; model {model}; {rounds} iterations "
        "each, schedules interleaved round-robin; iteration: the median; ratio: the median of each round's "
        "ratio to that round's megatron-core 1F1B (PyTorch's schedules: to that round's PyTorch Schedule1F1B).",
        "",
        f"Costs per stage (ms) from {PROFILED}'s passes (T_BW, the fused backward, from {FUSED}'s), profiled "
        f"before the timed rounds: {_costs(result['costs'])}; in the timed rounds: {_costs(result['in_run'])}. "
        "Ends: what the first block (embedding) and the last (output layer and loss) take beyond a block of "
        "layers alone; included in the first and last stage's time, planned on the blocks that hold them.",
        "",
        "Predicted ratios simulate the executed plans (planned with the costs profiled before) with the costs "
        f"profiled before, with those of {PROFILED}'s and {FUSED}'s passes measured in the timed rounds "
        "themselves, and with each run's own passes timed in the rounds (megatron-core's 1F1B with our 1f1b's, "
        "the same order); gain kept is the measured gain over megatron-core's 1F1B as a share of the predicted one. "
        "The interval: order statistics of the rounds' ratios that hold their median with at least 95% "
        "probability whatever their distribution.",
        "",
        "| schedule | iteration (ms) | vs megatron-core 1F1B (95% interval) | predicted ratio (costs before / in the "
        "rounds / own passes) | predicted bubble (in the rounds) | gain kept (costs before / in the rounds / own "
        "passes; interval in the rounds) |",
        "|---|---|---|---|---|---|",
    ]
    kept_by_name = {}
    for name in schedules:
        measured = ratio(result["times"], name, "megatron-1f1b")
        planned = [found[name][0] / found["megatron-1f1b"][0] for found in (before, during, own)]
        kept_by_name[name] = [(1 - measured) / (1 - p) if p < 0.999 else None for p in planned]
        kept = " / ".join("-" if k is None else f"{k:.0%}" for k in kept_by_name[name])
        low, high = median_interval(result["times"], name, "megatron-1f1b")
        if planned[1] < 0.999:  # the interval of the gain kept, with the costs in the rounds
            kept += f" ({(1 - high) / (1 - planned[1]):.0%}-{(1 - low) / (1 - planned[1]):.0%})"
        lines.append(
            f"| {name} | {times[name] * 1e3:.1f} | {measured:.3f} ({low:.3f}-{high:.3f}) | "
            f"{' / '.join(f'{p:.3f}' for p in planned)} | {during[name][1]:.1%} | {kept} |"
        )
    if peers:
        lines += ["", *peer_table(result, peers)]
        if "zb-v" in schedules and "torch-zbv" in peers:
            ours, theirs = (
                ratio(result["times"], "zb-v", "megatron-1f1b"),
                ratio(result["times"], "torch-zbv", REFERENCE),
            )
            kept = kept_by_name["zb-v"]
            lines += [
                "",
                f"zb-v: {ours:.3f} of megatron-core's 1F1B, keeping {' / '.join(map(_share, kept))} of its "
                f"predicted gain (costs before / in the rounds / own passes); PyTorch's ScheduleZBVZeroBubble: "
                f"{theirs:.3f} of PyTorch's Schedule1F1B; zb-v's ratio is "
                f"{'below' if ours < theirs else 'not below'} it.",
            ]
    lines += ["", *breakdown_table(results, schedules)]
    return "\n".join(lines) + "\n"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def peer_table(result: dict, peers: tuple[str, ...]) -> list[str]:
    """PyTorch's runtime: its schedules against its own Schedule1F1B, with our simulator's prediction of its orders."""
    before, during = result["peers"]["before"], result["peers"]["in_run"]
    lines = [
        "PyTorch's pipelining runtime (torch.distributed.pipelining, a plain PyTorch GPT of the same sizes), in "
        "the same rounds; predicted: our simulator on PyTorch's orders with the costs above (measured on the "
        "megatron-core model, so a guide only).",
        "",
        "| PyTorch schedule | iteration (ms) | vs PyTorch Schedule1F1B | predicted ratio (costs before / in the "
        "rounds) | gain kept (costs before / in the rounds) |",
        "|---|---|---|---|---|",
    ]
    for label in peers:
        measured = ratio(result["times"], label, REFERENCE)
        planned = [found[label] / found[REFERENCE] for found in (before, during)]
        kept = " / ".join(f"{(1 - measured) / (1 - p):.0%}" if p < 0.999 else "-" for p in planned)
        median = statistics.median(result["times"][label])
        lines.append(
            f"| {PEERS[label]} | {median * 1e3:.1f} | {measured:.3f} | {planned[0]:.3f} / {planned[1]:.3f} | {kept} |"
        )
    return lines


BREAKDOWN_COLUMNS = (
    ("span", "executor span"),
    ("compute", "compute"),
    ("w_split", "of which W split"),
    ("planned_wait", "planned wait"),
    ("unplanned_wait", "unplanned wait"),
    ("send_recv", "send/recv"),
    ("python", "Python between passes"),
)


def breakdown_table(results: list[dict], schedules: tuple[str, ...]) -> list[str]:
    """Per schedule and rank, ms per iteration: measured (predicted) for each part of the executor's span."""
    header = " | ".join(title for _, title in BREAKDOWN_COLUMNS)
    lines = [
        "Where each rank's time goes, ms per iteration (mean of the timed iterations), measured (predicted). "
        "Idle time = planned wait + unplanned wait + send/recv + Python; the W split (B + W beyond the fused "
        "BW of the same layers, T_BW measured in the rounds) is part of compute; outside: the rest of the "
        "iteration (the barrier that ends it).",
        "",
        f"| schedule | rank | {header} | outside |",
        "|---|---|" + "---|" * (len(BREAKDOWN_COLUMNS) + 1),
    ]
    for name in schedules:
        for rank, result in enumerate(results):
            if name not in result["idle"]:
                continue
            found = result["idle"][name]
            measured, planned = found["measured"], found["predicted"]
            cells = []
            for field, _ in BREAKDOWN_COLUMNS:
                value, plan = getattr(measured, field), getattr(planned, field)
                cells.append("-" if value is None else f"{value * 1e3:.1f} ({plan * 1e3:.1f})")
            lines.append(f"| {name} | {rank} | {' | '.join(cells)} | {found['outside'] * 1e3:.1f} |")
    return lines


def _ms(values) -> str:
    return "/".join(f"{v * 1e3:.1f}" for v in values)


def _costs(costs) -> str:
    ends = f"ends (first/last) F {_ms(costs.t_f_ends)}, B {_ms(costs.t_b_ends)}, W {_ms(costs.t_w_ends)}"
    fused = "" if costs.t_bw is None else f", T_BW {_ms(costs.t_bw)}"
    return (
        f"T_F {_ms(costs.t_f)}, T_B {_ms(costs.t_b)}, T_W {_ms(costs.t_w)}{fused}, T_comm {costs.t_comm * 1e3:.2f}, "
        f"{ends}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", "-m", type=int, default=8)
    parser.add_argument(
        "--rounds",
        type=int,
        help="timed rounds (default 48: a 95%% interval of about +-0.6%% on this CPU; 16 with --moe)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--output", help="also write the table to this markdown file")
    parser.add_argument("--no-pytorch", action="store_true", help="leave PyTorch's pipelining runtime out")
    parser.add_argument("--times", metavar="FILE", help="also write every round's iteration time (s) as JSON")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="the MoE section instead (pp 2 x expert parallel 2, overlapped F&B pairs; bench_runtime_moe.py): "
        "its own model sizes, so only --microbatches, --rounds, --warmup and --output apply",
    )
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 16 if args.moe else 48
    if args.moe:
        import bench_runtime_moe

        notes = kept_notes(args.output)
        bench_runtime_moe.run(args.microbatches, args.rounds, args.warmup, bench_runtime_moe.MODEL, args.output)
        if notes:
            with open(args.output, "a", encoding="utf-8") as handle:
                handle.write("\n" + notes)
        return
    from megatron_zb.testing.bench import report, run_on_cpu_ranks

    pp = 2
    model = dict(
        layers=args.layers, hidden=args.hidden, heads=8, seq=args.seq, micro_batch=args.micro_batch, vocab=1024
    )
    peers = () if args.no_pytorch else tuple(PEERS)
    results = run_on_cpu_ranks(
        pp,
        measure,
        schedules=SCHEDULES,
        peers=peers,
        pp=pp,
        m=args.microbatches,
        rounds=args.rounds,
        warmup=args.warmup,
        model=model,
    )
    if args.times:
        with open(args.times, "w", encoding="utf-8") as handle:
            json.dump(results[0]["times"], handle, indent=1)
    text = table(results, pp, args.microbatches, model, args.rounds, SCHEDULES, peers)
    notes = kept_notes(args.output)
    report(text, "Runtime benchmark", "bench_runtime.py", args.output)
    if notes:
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.write("\n" + notes)


def kept_notes(path: str | None) -> str:
    """The output page's prose from ``NOTES`` on, which a run does not measure and so must not erase."""
    try:
        with open(path or "", encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return ""
    start = text.find("\n" + NOTES + "\n")
    return text[start + 1 :] if start >= 0 else ""


if __name__ == "__main__":
    main()
