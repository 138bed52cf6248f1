"""The MoE section of the runtime benchmark (``bench_runtime.py --moe``): overlapped F&B pairs, measured and predicted.

Four gloo processes, one compute thread each: pp=2 and expert parallelism 2 (the alltoall dispatcher's tokens
cross between a stage's two ranks in every MoE layer; pp=2 so that megatron-core's 1F1B pipelines, EP=2 because
the all-to-all a pair hides needs EP > 1). A GPT whose every layer is MoE runs, round-robin: megatron-core's
1F1B, and each of our schedules as generated and with overlapped pairs: those the planner keeps with the
profiled costs (``pairing.overlap_pairs``, what ``ScheduleSpec.overlap_f_b`` plans), and every adjacent F/B
pair that can run (``testing.moe.pair_adjacent``: the most overlap the order allows, whatever it costs in
waits). Each is next to the
simulator's prediction from the costs profiled in the same rounds on the schedules without pairs (T_F, T_B,
T_W and the all-to-all times inside F and B; a pair's own passes are not timed apart): a pair predicted with
``CostModel.overlap`` 1 (ideal: it hides the smaller of both all-to-alls and both computes) and with the
overlap the pairs measured. The measured effective overlap is (T_F + T_B - pair) / (T_F + T_B - ideal pair)
over the timed pairs: 1 hides all it can, 0 nothing, below 0 the pair costs more than its two passes.

    python scripts/bench_runtime.py --moe --output docs/bench_overlap_runtime.md
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

SCHEDULES = ("1f1b", "zb-1p")
PAIRED = (" + planned pairs", " + all pairs")  # the suffixes of a schedule's paired runs
PROFILED = "zb-1p"  # planned with costs from its own passes (B and W apart), before the timed rounds
PROFILED_ITERATIONS = 3
PP, EP = 2, 2
MODEL = dict(layers=4, hidden=256, heads=8, experts=8, seq=128, micro_batch=2, vocab=1024)


def measure(m: int, rounds: int, warmup: int, model: dict) -> dict:
    """On every rank: profile, plan, then time megatron-core's 1F1B and our schedules with and without pairs."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.schedule.pairing import overlap_pairs
    from megatron_zb.testing.moe import moe_config, moe_gpt_stage, pair_adjacent
    from megatron_zb.testing.toy_gpt import forward_step

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, PP, expert_model_parallel_size=EP)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    config = moe_config(
        num_layers=model["layers"],
        pipeline_model_parallel_size=PP,
        expert_model_parallel_size=EP,
        hidden_size=model["hidden"],
        num_attention_heads=model["heads"],
        num_moe_experts=model["experts"],
        moe_ffn_hidden_size=model["hidden"],
        moe_aux_loss_coeff=1e-2,
        pipeline_dtype=torch.float32,
    )
    chunk = moe_gpt_stage(config, rank, model["vocab"], model["seq"])
    seq, micro = model["seq"], model["micro_batch"]
    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    batches = []
    for _ in range(m):
        tokens = torch.randint(0, model["vocab"], (micro, seq + 1), generator=generator)
        batches.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(micro, seq),
                "position_ids": torch.arange(seq).expand(micro, seq).contiguous(),
            }
        )

    def iteration(function) -> float:
        chunk.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        function(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[chunk],
            num_microbatches=m,
            seq_length=seq,
            micro_batch_size=micro,
        )
        dist.barrier()
        return time.perf_counter() - start

    group = parallel_state.get_pipeline_model_parallel_group()
    shape = (seq, micro, model["hidden"])
    profiler = PassProfiler()
    profiled = ForwardBackward(PROFILED, profiler=profiler)
    for index in range(warmup + PROFILED_ITERATIONS):
        if index == warmup:
            profiler.start()
        iteration(profiled)
    profiler.stop()
    costs = profiler.cost_model(profiled.schedule_for(PP, m), group, shape)

    runs, profilers, plans = {"megatron-1f1b": forward_backward_pipelining_without_interleaving}, {}, {}
    for name in SCHEDULES:
        plain = ForwardBackward(name, costs=costs, profiler=PassProfiler())
        plans[name] = plain.schedule_for(PP, m)
        runs[name], profilers[name] = plain, plain.profiler
        for suffix, paired in zip(PAIRED, (overlap_pairs(plans[name], costs), pair_adjacent(plans[name])), strict=True):
            if paired.overlapped:  # the planner may keep none
                runner = ForwardBackward(name, costs=costs, profiler=PassProfiler())
                runner.use_schedule(paired)
                plans[name + suffix], runs[name + suffix], profilers[name + suffix] = paired, runner, runner.profiler
    for _ in range(warmup):
        for function in runs.values():
            iteration(function)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds):
        for name, function in runs.items():
            found = profilers.get(name)
            if found is not None:
                found.iteration = index
                found.start()
            times[name].append(iteration(function))
            if found is not None:
                found.stop()
    in_run = {name: profilers[name].cost_model(plans[name], group, shape) for name in SCHEDULES}
    pairs = {
        label: _pair_spans(profilers[label].records, in_run[_base(label)], plans[label])
        for label in runs
        if label in plans and plans[label].overlapped
    }
    return {"times": times, "costs": costs, "in_run": in_run, "plans": plans, "pairs": pairs}


def _pair_spans(records: list, costs, schedule) -> list[tuple[float, float, float]]:
    """(measured, plain, ideal) seconds of every timed pair: its span, its two passes' costs, the ideal pair's."""
    found = []
    placements = schedule.placements
    for record in records:
        if record.partner is None or record.pass_.kind.value != "F":
            continue
        partner = next(r for r in records if r.pass_ == record.partner and r.iteration == record.iteration)
        forward, backward = record.pass_, partner.pass_
        plain = sum(costs.duration(p, placements[p.pipe]) for p in (forward, backward))
        ideal = costs.pair_time(forward, backward, placements)
        found.append((max(record.end, partner.end) - min(record.start, partner.start), plain, ideal))
    return found


def _base(label: str) -> str:
    """The schedule a run's label names (its pairs' suffix removed)."""
    for suffix in PAIRED:
        label = label.removesuffix(suffix)
    return label


def effective_overlap(spans: list[tuple[float, float, float]]) -> float | None:
    """(plain - measured) / (plain - ideal), summed over the pairs; None where nothing could be hidden."""
    hideable = sum(plain - ideal for _, plain, ideal in spans)
    if hideable <= 0:
        return None
    return sum(plain - measured for measured, plain, _ in spans) / hideable


def table(results: list[dict], m: int, model: dict, rounds: int) -> str:
    from megatron_zb.schedule import simulate

    result = results[0]
    times, plans = result["times"], result["plans"]
    reference = "megatron-1f1b"
    load = os.getloadavg()[0]
    lines = [
        f"pp={PP}, expert parallelism {EP} (4 gloo processes, one compute thread each, on "
        f"{os.cpu_count()} cores; load average {load:.1f} when the table was written, its own processes "
        f"included); m={m}; model {model} (every layer MoE, top-2, alltoall dispatcher); {rounds} rounds, "
        "runs interleaved round-robin; iteration: the median; ratio: the median of each round's ratio to that "
        "round's megatron-core 1F1B.",
        "",
        "Predicted: the simulator on each executed plan with the costs profiled in the same rounds on the "
        "schedule's run without pairs (all ranks' mean); a pair at overlap 1 (ideal) and at the overlap its "
        "pairs measured (held to [-1, 1]). Planned pairs: those the planner keeps with the costs profiled before "
        "the rounds; all pairs: every adjacent F/B pair that can run. Effective overlap: what the pairs hid as "
        "a share of what they could hide (both sides' all-to-all or the rest of both passes, the smaller), over "
        "every rank's timed pairs.",
        "",
        "| run | pairs | iteration (ms) | vs megatron-core 1F1B | predicted ratio (overlap 1 / measured) "
        "| effective overlap |",
        "|---|---|---|---|---|---|",
    ]
    for name in times:
        costs = result["in_run"]["1f1b" if name == reference else _base(name)]
        measured = statistics.median(t / b for t, b in zip(times[name], times[reference], strict=True))
        plan = plans["1f1b" if name == reference else name]
        overlap = None
        if plan.overlapped:
            overlap = effective_overlap([span for found in results for span in found["pairs"][name]])
        denominator = simulate(plans["1f1b"], costs).makespan
        ideal = simulate(plan, costs).makespan / denominator
        at = ideal if overlap is None else simulate(plan, _with_overlap(costs, overlap)).makespan / denominator
        lines.append(
            f"| {name} | {len(plan.overlapped)} | {statistics.median(times[name]) * 1e3:.1f} | {measured:.3f} "
            f"| {ideal:.3f} / {at:.3f} | {'-' if overlap is None else f'{overlap:.2f}'} |"
        )
    lines += ["", "Costs in the rounds, per stage (ms):", ""]
    for name in SCHEDULES:
        costs = result["in_run"][name]
        lines.append(
            f"- {name}: T_F {_ms(costs.t_f)}, T_B {_ms(costs.t_b)}, T_W {_ms(costs.t_w)}, all-to-all in F "
            f"{_ms(costs.t_a2a)}, in B {_ms(costs.t_a2a_b)}, T_comm {costs.t_comm * 1e3:.2f}"
        )
    return "\n".join(lines) + "\n"


def _with_overlap(costs, overlap: float):
    return dataclasses.replace(costs, overlap=max(-1.0, min(1.0, overlap)))


def _ms(values) -> str:
    return "/".join(f"{v * 1e3:.1f}" for v in values)


def run(m: int, rounds: int, warmup: int, model: dict, output: str | None) -> None:
    """Measure on four CPU ranks and print (and with ``output``, write) the table."""
    from megatron_zb.testing.bench import report, run_on_cpu_ranks

    results = run_on_cpu_ranks(PP * EP, measure, m=m, rounds=rounds, warmup=warmup, model=model)
    report(
        table(results, m, model, rounds), "Overlapped F&B pairs in the runtime (MoE)", "bench_runtime.py --moe", output
    )
