"""Benchmark (not a test): our automatic schedules against the reference planners on drawn cost profiles.

    python scripts/bench_vs_reference.py --reference /tmp/zbref/.../zerobubble/scheduler \\
        [--settings 120] [--seed 4040] [--cache /tmp/bench_vs_reference.json] [--output docs/bench_vs_reference.md]

The reference is the ZB authors' implementation (sail-sg/zero-bubble-pipeline-parallelism); pass the path of
a fetched copy of its ``zerobubble/scheduler`` folder. Nothing of it is kept here: its planners are run in
process from that path, their orders converted to our ``Schedule`` and timed by our simulator on the true
per-stage costs, exactly as ours are. zb-1p and zb-2p come from its zb.py (per-stage costs, limit pp and 2pp
stage activations), zb-v from zbv.py, v-half and v-min from zbv_greedy.py; those three take one cost per pass
kind, and get the median over the stages (halved for a chunk), as the issue's reporter ran them
(``--planning-cost mean`` gives the mean, as scripts/bench_schedules.py's REFERENCE did).

Settings (drawn with ``--seed``): pp 4-16, m from pp to 8pp, per-stage T_F 0.8-1.2 with the first and last
stage 1.1-1.6x heavier, T_B/T_F 0.9-2.2, T_W/T_B 0.2-1.0, T_comm up to 25 % of the mean T_F; memory F +1,
B -0.55, W -0.45. The reference's timings do not depend on our code and are kept in ``--cache``, so a rerun
after a change to our planners only plans ours.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import PassKind, Schedule, made_pass
from megatron_zb.schedule.placement import Placement, linear, v_shape
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate

SCHEDULES = ("zb-1p", "zb-2p", "zb-v", "v-half", "v-min")
MEM_F, MEM_B, MEM_W = 1.0, -0.55, -0.45
EPS = 1e-9


@dataclass(frozen=True)
class Setting:
    pp: int
    m: int
    t_f: tuple[float, ...]
    b_ratio: float
    w_ratio: float
    comm: float

    def costs(self) -> CostModel:
        t_b = [self.b_ratio * x for x in self.t_f]
        return CostModel(
            self.pp,
            t_f=list(self.t_f),
            t_b=t_b,
            t_w=[self.w_ratio * x for x in t_b],
            t_comm=self.comm,
            mem_f=MEM_F,
            mem_b=MEM_B,
            mem_w=MEM_W,
        )

    def key(self) -> str:
        return json.dumps([self.pp, self.m, self.t_f, self.b_ratio, self.w_ratio, self.comm])


def draw(count: int, seed: int) -> list[Setting]:
    """The issue's distribution, rounded to 4 digits so the costs print exactly."""
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        pp = rng.randint(4, 16)
        m = rng.randint(pp, 8 * pp)
        t_f = [rng.uniform(0.8, 1.2) for _ in range(pp)]
        for end in (0, pp - 1):
            t_f[end] *= rng.uniform(1.1, 1.6)
        comm = rng.uniform(0.0, 0.25) * statistics.mean(t_f)
        rounded = tuple(round(x, 4) for x in t_f)
        found.append(
            Setting(pp, m, rounded, round(rng.uniform(0.9, 2.2), 4), round(rng.uniform(0.2, 1.0), 4), round(comm, 4))
        )
    return found


# -- the reference, run in process ---------------------------------------------------------------
def load_reference(path: str) -> dict[str, types.ModuleType]:
    """The reference's planner modules from ``path`` (its imports of megatron.core.* are mapped onto it;
    zb.py imports torch and pulp for its solver, which the heuristic we run does not use)."""
    folder = Path(path).resolve()
    package = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    parts = package.split(".")
    for depth in range(len(parts)):
        full = ".".join(parts[: depth + 1])
        if full not in sys.modules or full == package:
            module = types.ModuleType(full)
            module.__path__ = [str(folder)] if full == package else []
            sys.modules[full] = module
    if "pulp" not in sys.modules:
        sys.modules["pulp"] = types.SimpleNamespace(value=lambda x: x)
    import importlib

    return {name: importlib.import_module(f"{package}.{name}") for name in ("graph", "zb", "zbv", "zbv_greedy")}


def converted(name: str, nodes, placement: Placement, m: int) -> Schedule:
    """The reference's per-rank ``ScheduledNode`` lists as our schedule: its layer group is our stage."""
    kinds = {"F": PassKind.F, "B": PassKind.B, "W": PassKind.W}
    orders = tuple(
        tuple(made_pass(kinds[n.type.value], n.layer_group_idx, n.microbatch) for n in rank) for rank in nodes
    )
    return Schedule(name, (placement,), m, orders)


def scaled(values) -> list[float]:
    """Costs in 10^-4 units, whole numbers: zb.py checks its own timing with exact comparisons."""
    return [float(round(x * 1e4)) for x in values]


def planning_cost(values, how: str) -> float:
    return statistics.median(values) if how == "median" else statistics.mean(values)


def reference_schedule(ref, name: str, p: int, m: int, costs: CostModel, how: str) -> Schedule:
    """The reference's plan of ``name``, converted (its planners print; the caller may silence them)."""
    config = types.SimpleNamespace(max_chunks=2, n_stages=p, n_micro=m)
    if name in ("zb-1p", "zb-2p"):
        graph_config = ref["graph"].GraphConfig(
            mem_f=[20.0] * p,  # memory in twentieths of a stage's activations: F + B + W is exactly 0
            mem_b=[-11.0] * p,
            mem_w=[-9.0] * p,
            max_mem=[20.0 * (p if name == "zb-1p" else 2 * p)] * p,
            cost_f=scaled(costs.t_f),
            cost_b=scaled(costs.t_b),
            cost_w=scaled(costs.t_w),
            cost_comm=scaled([costs.t_comm])[0],
            n_stages=p,
            n_micro=m,
        )
        return converted(name, ref["zb"].create_schedule(graph_config), linear(p), m)
    f, b, w = (planning_cost(values, how) / 2 for values in (costs.t_f, costs.t_b, costs.t_w))
    if name == "zb-v":
        # memory in twentieths of a chunk's activations, as for zb.py
        graph = ref["zbv"].PipelineGraph(p, m, f, b, w, costs.t_comm, 20, -11, -9, 40 * p)
    else:
        graph = ref["zbv_greedy"].PipelineGraph(p, m, name[2:], f, b, w, costs.t_comm)
    return converted(name, graph.create_schedule(config), v_shape(p), m)


def timed(schedule: Schedule, costs: CostModel) -> dict[str, float]:
    timeline = simulate(schedule, costs)
    return {"span": timeline.bubble_rate, "makespan": timeline.bubble_rate_makespan, "peak": max(timeline.peak_memory)}


def reference_rows(ref, setting: Setting, how: str) -> dict[str, dict[str, float]]:
    """Each schedule's timing, or None where the reference's planner failed (its own asserts)."""
    rows = {}
    for name in SCHEDULES:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the reference prints every plan
                schedule = reference_schedule(ref, name, setting.pp, setting.m, setting.costs(), how)
        except AssertionError:
            rows[name] = None
            continue
        rows[name] = timed(schedule, setting.costs())
    return rows


def our_rows(setting: Setting) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    rows, seconds = {}, {}
    costs = setting.costs()
    for name in SCHEDULES:
        start = time.process_time()
        schedule = build(name, ScheduleSpec(setting.pp, setting.m, costs=costs))
        seconds[name] = time.process_time() - start
        rows[name] = timed(schedule, costs)
    return rows, seconds


# -- the table ------------------------------------------------------------------------------------
def v_auto_at(setting: Setting, peak: float) -> dict[str, float]:
    """Our V schedule planned at a given peak (the reference's, where its V schedule peaks above ours)."""
    costs = setting.costs()
    return timed(build("v-auto", ScheduleSpec(setting.pp, setting.m, costs=costs, memory_limit=peak)), costs)


def losing(ours: dict[str, float], theirs: dict[str, float]) -> tuple[bool, bool]:
    """Whether the reference is better on stage span / makespan at no more memory than ours."""
    same_memory = theirs["peak"] <= ours["peak"] + EPS
    return (
        same_memory and theirs["span"] < ours["span"] - 1e-6,
        same_memory and theirs["makespan"] < ours["makespan"] - 1e-6,
    )


def describe(setting: Setting) -> str:
    ends = f"T_F {min(setting.t_f):.3g}-{max(setting.t_f):.3g} (ends {setting.t_f[0]:g}, {setting.t_f[-1]:g})"
    ratios = f"B/F {setting.b_ratio:g}, W/B {setting.w_ratio:g}, comm {setting.comm:g}"
    return f"pp {setting.pp}, m {setting.m}, {ends}, {ratios}"


def report(settings, ours, theirs, seconds, args) -> str:
    lines = [
        "# Our automatic schedules against the reference planners",
        "",
        f"Made by `python scripts/bench_vs_reference.py --settings {args.settings} --seed {args.seed} "
        f"--planning-cost {args.planning_cost} --reference <its scheduler folder>` (see the script's docstring): "
        f"{len(settings)} drawn settings, each schedule planned by ours and by the reference "
        "(sail-sg/zero-bubble-pipeline-parallelism: zb.py, zbv.py, zbv_greedy.py), both timed by our simulator on "
        "the true per-stage costs. A row is lost when the reference's bubble is lower at a peak memory not above "
        "ours; `at a higher peak` counts the settings where the reference is better but peaks above ours (in "
        "brackets: those where our v-auto, given the reference's peak as its limit, is still worse), "
        "`reference failed` those where its planner stopped on one of its own asserts (means: over the others).",
        "",
        "| schedule | span worse | makespan worse | reference failed | worst span gap (points) | worst makespan gap "
        "| reference better at a higher peak | our mean span | reference mean span | our planning (s, mean / max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for name in SCHEDULES:
        span_lost = full_lost = higher = higher_lost = 0
        span_gap = full_gap = 0.0
        planned = [index for index in range(len(settings)) if theirs[index][name] is not None]
        for index in planned:
            mine, other = ours[index][name], theirs[index][name]
            span, full = losing(mine, other)
            span_lost += span
            full_lost += full
            if span:
                span_gap = max(span_gap, mine["span"] - other["span"])
            if full:
                full_gap = max(full_gap, mine["makespan"] - other["makespan"])
            if other["peak"] > mine["peak"] + EPS and other["span"] < mine["span"] - 1e-6:
                higher += 1
                at_peak = v_auto_at(settings[index], other["peak"])
                higher_lost += at_peak["span"] > other["span"] + 1e-6
            if span or full:
                rows.append((name, index, mine, other))
        times = [seconds[index][name] for index in range(len(settings))]
        mean_ours = statistics.mean(ours[i][name]["span"] for i in planned)
        mean_theirs = statistics.mean(theirs[i][name]["span"] for i in planned)
        lines.append(
            f"| {name} | {span_lost} | {full_lost} | {len(settings) - len(planned)} | {100 * span_gap:.2f} | "
            f"{100 * full_gap:.2f} | {higher} ({higher_lost}) | "
            f"{mean_ours:.2%} | {mean_theirs:.2%} | {statistics.mean(times):.2f} / {max(times):.2f} |"
        )
    lines += ["", "## Rows where the reference is better at the same memory", ""]
    if not rows:
        lines.append("None.")
    else:
        lines += [
            "| schedule | # | setting | ours span / makespan (peak) | reference span / makespan (peak) |",
            "|---|---|---|---|---|",
        ]
        for name, index, mine, other in rows:
            lines.append(
                f"| {name} | {index} | {describe(settings[index])} | {mine['span']:.2%} / {mine['makespan']:.2%} "
                f"({mine['peak']:g}) | {other['span']:.2%} / {other['makespan']:.2%} ({other['peak']:g}) |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="a fetched copy of the reference's zerobubble/scheduler")
    parser.add_argument("--settings", type=int, default=120)
    parser.add_argument("--seed", type=int, default=4040)
    parser.add_argument("--planning-cost", choices=("median", "mean"), default="median")
    parser.add_argument("--cache", help="JSON file keeping the reference's timings between runs")
    parser.add_argument("--output", help="write the Markdown table here")
    parser.add_argument("--only", type=int, nargs="*", help="run only these setting indices (no table)")
    args = parser.parse_args()
    ref = load_reference(args.reference)
    settings = draw(args.settings, args.seed)
    cache = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache, encoding="utf-8") as handle:
            cache = json.load(handle)
    ours, theirs, seconds = [], [], []
    for index, setting in enumerate(settings):
        if args.only is not None and index not in args.only:
            continue
        key = f"{args.planning_cost} {setting.key()}"
        if key not in cache:
            cache[key] = reference_rows(ref, setting, args.planning_cost)
            if args.cache:
                with open(args.cache, "w", encoding="utf-8") as handle:
                    json.dump(cache, handle)
        mine, spent = our_rows(setting)
        ours.append(mine)
        theirs.append(cache[key])
        seconds.append(spent)
        gaps = " ".join(
            f"{n} {100 * (mine[n]['span'] - cache[key][n]['span']):+.2f}"
            for n in SCHEDULES
            if cache[key][n] is not None
        )
        print(f"{index:3d} {describe(setting)}: {gaps}", flush=True)
    if args.only is None:
        table = report(settings, ours, theirs, seconds, args)
        print(table)
        if args.output:
            Path(args.output).write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
