"""Benchmark (not a test): how long planning takes, ours and the reference planner's.

    python scripts/bench_planner.py [--repeat 3] [--reference PATH] [--output docs/bench_planner.md]
    python scripts/bench_planner.py --tables uneven      # one table, printed only

Three tables, each run timed in a fresh process (so no plan cached by an earlier run counts), best of
--repeat, in CPU seconds of that process (``time.process_time``: other work on a shared machine does not
count) and wall seconds:

1. The searched schedules with the ZB paper's measured profile (T_F 18522, T_B 18086, T_W 9337, T_comm
   601; memory F +1, B -0.55, W -0.45), every stage equal: generation, and validation as ``build`` runs it.
2. The same profile with uneven stages (the first stage's times x1.4, the last stage's x1.6), and, with
   ``--reference PATH`` (the ``zerobubble/scheduler`` folder of a fetched copy of
   sail-sg/zero-bubble-pipeline-parallelism), the reference's planner for the same schedule on the same
   setting, timed the same way, and the ratio. Nothing of the reference is kept here: its modules are
   loaded from PATH in the timing process. Its zb.py (zb-1p, zb-2p) takes per-stage costs; zbv.py (zb-v),
   zbv_greedy.py (v-half, v-min) and v_auto_schedule.py (v-auto) take one cost per pass kind (the median
   stage's, halved for a chunk). It has no ``auto``.
3. The handmade generators, plan + validate + simulate, in this process (wall seconds).

Targets (issue 40): uneven stages, ``auto`` pp 32/m 256 under 3 s, every single schedule pp 32/m 256 under
1 s, v-auto pp 64/m 512 under 5 s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

SIZES = [(p, m) for p in (8, 32, 64) for m in (4 * p, 8 * p)]
HANDMADE = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"]
# (pp, m, schedule, --memory-limit as a multiple of pp or None)
SEARCHED = [
    (32, 256, "zb-1p", None),
    (32, 256, "zb-2p", None),
    (32, 256, "zb-v", None),
    (32, 256, "v-half", None),
    (32, 256, "v-min", None),
    (32, 256, "v-auto", 0.5),
    (32, 256, "v-auto", 0.75),
    (32, 256, "v-auto", 1.0),
    (64, 512, "zb-2p", None),
    (64, 512, "zb-v", None),
    (64, 512, "v-auto", 0.5),
    (64, 512, "v-auto", 0.75),
    (64, 512, "v-auto", 1.0),
]
UNEVEN = [
    (32, 256, "zb-1p", None),
    (32, 256, "zb-2p", None),
    (32, 256, "zb-v", None),
    (32, 256, "v-half", None),
    (32, 256, "v-min", None),
    (32, 256, "v-auto", 1.0),
    (32, 256, "auto", 1.0),
    (64, 512, "zb-2p", None),
    (64, 512, "zb-v", None),
    (64, 512, "v-auto", 1.0),
]
FIRST, LAST = 1.4, 1.6  # the uneven profile's first and last stage, times the others
CHILD_SECONDS = 180  # a timing process that runs longer is reported as over this
LONG_SECONDS = 60  # a planner whose first run takes longer is not run again


def paper_costs(p: int, uneven: bool = False):
    from megatron_zb.schedule.costs import CostModel

    def per_stage(base: float) -> tuple[float, ...]:
        scale = [(FIRST if s == 0 else LAST if s == p - 1 else 1.0) if uneven else 1.0 for s in range(p)]
        return tuple(base * x for x in scale)

    return CostModel(
        p,
        t_f=per_stage(18522),
        t_b=per_stage(18086),
        t_w=per_stage(9337),
        t_comm=601,
        mem_f=1,
        mem_b=-0.55,
        mem_w=-0.45,
    )


# ---- in the timing process ----------------------------------------------------------------------


def ours(job: dict) -> dict:
    """Generate (and validate) one of our schedules; CPU and wall seconds of each."""
    from megatron_zb.schedule.registry import ScheduleSpec, get
    from megatron_zb.schedule.simulate import simulate
    from megatron_zb.schedule.validate import check

    p, m, limit = job["pp"], job["m"], job["limit"]
    costs = paper_costs(p, job["uneven"])
    spec = ScheduleSpec(p, m, costs=costs, memory_limit=limit)
    cpu, wall = time.process_time(), time.perf_counter()
    schedule = get(job["name"]).generate(spec)
    generated = time.process_time() - cpu, time.perf_counter() - wall
    cpu = time.process_time()
    check(schedule, costs)
    validated = time.process_time() - cpu
    return {
        "cpu": generated[0],
        "wall": generated[1],
        "validate": validated,
        "bubble": simulate(schedule, costs).bubble_rate,
    }


def load_reference(path: str) -> dict[str, types.ModuleType]:
    """The reference's planner modules from ``path``, its ``megatron.core...scheduler`` package mapped onto
    the folder (zb.py imports torch and pulp for its solver; the heuristic timed here uses neither)."""
    package = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    parts = package.split(".")
    for depth in range(len(parts)):  # empty packages above it: megatron-core's own need not load
        name = ".".join(parts[: depth + 1])
        module = types.ModuleType(name)
        module.__path__ = [str(Path(path).resolve())] if name == package else []
        sys.modules[name] = module
    sys.modules.setdefault("pulp", types.SimpleNamespace(value=lambda x: x))
    import importlib

    modules = ("graph", "zb", "zbv", "zbv_greedy", "v_auto_schedule")
    return {name: importlib.import_module(f"{package}.{name}") for name in modules}


def reference(job: dict) -> dict:
    """Plan one schedule with the reference's planner; CPU and wall seconds (its prints silenced)."""
    ref = load_reference(job["reference"])
    p, m, name = job["pp"], job["m"], job["name"]
    costs = paper_costs(p, job["uneven"])
    f, b, w = (statistics.median(values) / 2 for values in (costs.t_f, costs.t_b, costs.t_w))
    config = types.SimpleNamespace(max_chunks=2, n_stages=p, n_micro=m)

    def run():
        if name in ("zb-1p", "zb-2p"):
            graph = ref["graph"].GraphConfig(
                mem_f=[20.0] * p,  # twentieths of a stage's activations: F + B + W is exactly 0
                mem_b=[-11.0] * p,
                mem_w=[-9.0] * p,
                max_mem=[20.0 * p * (1 if name == "zb-1p" else 2)] * p,
                cost_f=[float(round(x)) for x in costs.t_f],
                cost_b=[float(round(x)) for x in costs.t_b],
                cost_w=[float(round(x)) for x in costs.t_w],
                cost_comm=float(round(costs.t_comm)),
                n_stages=p,
                n_micro=m,
            )
            return ref["zb"].create_schedule(graph)
        if name == "zb-v":
            return ref["zbv"].PipelineGraph(p, m, f, b, w, costs.t_comm, 20, -11, -9, 40 * p).create_schedule(config)
        if name in ("v-half", "v-min"):
            return ref["zbv_greedy"].PipelineGraph(p, m, name[2:], f, b, w, costs.t_comm).create_schedule(config)
        if name == "v-auto":  # its memory in chunk activations: two per stage
            return ref["v_auto_schedule"].schedule(p, m, (f, b, w, costs.t_comm), 2 * job["limit"])
        raise ValueError(f"the reference has no planner for {name}")

    sys.setrecursionlimit(1_000_000)  # v_auto_schedule.py times its plans recursively, m passes deep
    cpu, wall = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        run()
    return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}


# ---- in the parent --------------------------------------------------------------------------------


def timed(job: dict, repeat: int) -> dict | None:
    """The best of ``repeat`` fresh timing processes (per field; one if it took over ``LONG_SECONDS``); None if
    one failed or ran over ``CHILD_SECONDS``."""
    runs: list[dict] = []
    for _ in range(repeat):
        if runs and runs[0]["wall"] > LONG_SECONDS:
            break  # one run of a slow planner says enough
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--job", json.dumps(job)],
                capture_output=True,
                text=True,
                timeout=CHILD_SECONDS,
            )
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0:
            print(f"  {job}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {key: min(run[key] for run in runs) for key in runs[0]}


def searched_table(repeat: int) -> list[str]:
    lines = [
        f"Searched schedules, the paper's profile with equal stages: CPU seconds (best of {repeat}, a fresh process "
        "each) to generate, and to validate as `build` does; stage-span bubble in the last column.",
        "",
        "| pp | m | schedule | generate (s) | validate (s) | total (s) | bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, m, name, factor in SEARCHED:
        limit = None if factor is None else factor * p
        got = timed({"side": "ours", "name": name, "pp": p, "m": m, "limit": limit, "uneven": False}, repeat)
        label = name if limit is None else f"{name} (limit {limit:g})"
        if got is None:
            lines.append(f"| {p} | {m} | {label} | failed | | | |")
        else:
            seconds = f"{got['cpu']:.2f} | {got['validate']:.2f} | {got['cpu'] + got['validate']:.2f}"
            lines.append(f"| {p} | {m} | {label} | {seconds} | {got['bubble']:.2%} |")
        print(lines[-1], flush=True)
    return lines


def _seconds(got: dict | None) -> str:
    return f"> {CHILD_SECONDS}" if got is None else f"{got['cpu']:.2f} / {got['wall']:.2f}"


def uneven_table(repeat: int, reference_path: str | None) -> list[str]:
    lines = [
        f"Uneven stages (the paper's profile, first stage x{FIRST}, last x{LAST}): seconds to generate, CPU / wall "
        f"(best of {repeat}, a fresh process each); the reference's planner on the same setting, timed the same "
        "way; ratio of CPU seconds, ours over the reference's. Limits in stage activations (the reference's "
        "v-auto gets twice as many chunk activations).",
        "",
        "| pp | m | schedule | ours CPU / wall (s) | reference CPU / wall (s) | ratio | our bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, m, name, factor in UNEVEN:
        limit = None if factor is None else factor * p
        job = {"name": name, "pp": p, "m": m, "limit": limit, "uneven": True}
        mine = timed({**job, "side": "ours"}, repeat)
        theirs = None
        if reference_path and name != "auto":
            theirs = timed({**job, "side": "reference", "reference": reference_path}, repeat)
        label = name if limit is None else f"{name} (limit {limit:g})"
        if not reference_path or name == "auto":
            ref_cell, ratio = "n/a", "n/a"
        else:
            ref_cell = _seconds(theirs)
            ratio = "n/a" if theirs is None or mine is None else f"{mine['cpu'] / max(theirs['cpu'], 1e-3):.1f}"
        bubble = "failed" if mine is None else f"{mine['bubble']:.2%}"
        lines.append(f"| {p} | {m} | {label} | {_seconds(mine)} | {ref_cell} | {ratio} | {bubble} |")
        print(lines[-1], flush=True)
    return lines


def plan_seconds(name: str, p: int, m: int, repeat: int) -> tuple[float, float]:
    """Plan (uncached), validate and simulate: best wall seconds, and the stage-span bubble."""
    from megatron_zb.schedule.registry import ScheduleSpec, get
    from megatron_zb.schedule.simulate import simulate
    from megatron_zb.schedule.validate import check

    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        spec = ScheduleSpec(p, m)
        schedule = get(name).generate(spec)
        check(schedule, spec.cost_model())
        timeline = simulate(schedule, spec.cost_model())
        best = min(best, time.perf_counter() - start)
    return best, timeline.bubble_rate


def handmade_table(repeat: int) -> list[str]:
    lines = [
        f"Handmade generators: plan + validate + simulate, wall seconds (best of {repeat}); stage-span bubble in "
        "brackets.",
        "",
        "| pp | m | " + " | ".join(HANDMADE) + " |",
        "|---|---|" + "---|" * len(HANDMADE),
    ]
    for p, m in SIZES:
        cells = []
        for name in HANDMADE:
            seconds, bubble = plan_seconds(name, p, m, repeat)
            cells.append(f"{seconds:.3f} ({bubble:.1%})")
        lines.append(f"| {p} | {m} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reference", help="the zerobubble/scheduler folder of a fetched copy of the reference")
    parser.add_argument("--output", help="also write the tables to this Markdown file")
    parser.add_argument(
        "--tables",
        default="uneven,searched,handmade",
        help="which tables to run, comma-separated (default: all three; --output needs all three)",
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)  # a timing process: one JSON job
    args = parser.parse_args()
    chosen = args.tables.split(",")
    makers = {
        "uneven": lambda: uneven_table(args.repeat, args.reference),
        "searched": lambda: searched_table(args.repeat),
        "handmade": lambda: handmade_table(args.repeat),
    }
    if not set(chosen) <= set(makers) or (args.output and set(chosen) != set(makers)):
        parser.error(f"--tables takes some of {', '.join(makers)} (all three with --output), got {args.tables}")
    if args.job:
        job = json.loads(args.job)
        print(json.dumps(ours(job) if job["side"] == "ours" else reference(job)))
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the "
        f"start, Python {platform.python_version()}."
    )
    tables = [makers[name]() for name in makers if name in chosen]
    table = "\n\n".join([head, *("\n".join(lines) for lines in tables)])
    print()
    print(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            command = "python scripts/bench_planner.py" + (" --reference PATH" if args.reference else "")
            handle.write(f"# Planner benchmark\n\nMade by `{command} --output {args.output}`.\n\n{table}\n")


if __name__ == "__main__":
    main()
