"""The ``megatron-zb`` command: plan, simulate and draw schedules (no torch needed)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .checks import breadth_first_group
from .compare import compare
from .flags.commands import COMPARE, PLAN
from .flags.table import add_to
from .schedule.costs import CostModel
from .schedule.costs_file import load_costs
from .schedule.ir import Schedule, ScheduleError
from .schedule.iterations import IterationsTimeline, simulate_iterations
from .schedule.lower import DataParallel, add_all_to_all, lower
from .schedule.pairing import overlap_pairs
from .schedule.registry import ScheduleSpec, build, get, names
from .schedule.schedule_file import load_schedule, refuse_other_setting
from .schedule.simulate import Timeline, simulate
from .schedule.torch_csv import write_torch_csv
from .schedule.validate import check


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-zb", description="Zero-bubble pipeline schedules for Megatron.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="generate, validate, simulate and draw one schedule")
    add_to(plan, PLAN, checked=True)
    compare = commands.add_parser(
        "compare",
        help="every schedule for one setting (each family at every chunk count auto searches, PyTorch's orders, "
        "auto's pick): bubbles, peak memory, communication, the best under --memory-limit, the Pareto frontier",
    )
    add_to(compare, COMPARE, checked=True)
    commands.add_parser("list", help="the registered schedules, one line each")
    commands.add_parser(
        "train",
        help="train a GPT on megatron-core with a schedule (pretrain_gpt flags; --cpu spawns gloo processes); "
        "`megatron-zb train --help` lists them",
        add_help=False,
    )
    commands.add_parser(
        "verify",
        help="check a pretrain_gpt setting on CPU first: a scaled-down copy trains with megatron-core's schedule "
        "and with yours, losses and gradients compared; `megatron-zb verify --help`",
        add_help=False,
    )
    return parser


_UNIT_COSTS = {
    "cost_f": (1.0,), "cost_b": (1.0,), "cost_w": (1.0,), "cost_bw": None, "cost_comm": 0.0, "cost_a2a": (0.0,)
}  # fmt: skip
_MEMORY = {"mem_f": (1.0,), "mem_b": (-0.5,), "mem_w": (-0.5,)}
_DATA_PARALLEL = {"cost_dp": (0.0,), "mem_param": (0.0,)}


def _breadth_first(args: argparse.Namespace, microbatches: int) -> int | None:
    """Microbatches per breadth-first group, from either knob (both: they must multiply to the microbatches)."""
    try:
        return breadth_first_group(args.breadth_first_micro_batches, args.depth_first_micro_batches, microbatches)
    except ValueError as error:
        raise ScheduleError(str(error)) from None


def data_parallel(args: argparse.Namespace) -> DataParallel | None:
    """How to lower the schedules for the data-parallel flags; None without any of them."""
    if getattr(args, "prefetch", None) is not None and not args.zero3:
        raise ScheduleError("--prefetch applies to the weight gathers of --zero3; add --zero3 or drop --prefetch")
    given = [name for name in _DATA_PARALLEL if getattr(args, name, None) is not None] + (
        ["zero3"] if getattr(args, "zero3", False) else []
    )
    if not given:
        return None
    prefetch = 1 if args.prefetch is None else args.prefetch
    return DataParallel(gather="windows" if args.zero3 else "none", prefetch=prefetch)


# The largest setting plan and compare take, in passes (F, B, W per microbatch and stage, 2 stages per rank
# unless --chunks says otherwise): pp 128 with 1024 microbatches, about 30 s and 0.7 GB for zb-v here.
MAX_PASSES = 3 * 2 * 128 * 1024


def check_size(pp: int, microbatches: int, chunks: int | None) -> None:
    """Refuse a setting too large to plan in reasonable time and memory, naming the limit."""
    passes = 3 * max(chunks or 2, 2) * pp * microbatches
    if passes > MAX_PASSES:
        raise ScheduleError(
            f"--pp {pp} with --microbatches {microbatches} is {passes:,} passes (F, B and W of every microbatch on "
            f"every stage, {max(chunks or 2, 2)} stages per rank); plan and compare take at most {MAX_PASSES:,} "
            "(e.g. pp 128 with 1024 microbatches: about 30 s and 0.7 GB for zb-v): plan fewer microbatches (a "
            "schedule's bubble changes little past 8 x pp) or a smaller pipeline"
        )


def _spec(args: argparse.Namespace, refine_seconds: float = 0.0) -> ScheduleSpec:
    """The ScheduleSpec of the setting flags; raises ScheduleError for a bad cost model."""
    if args.costs_from:
        return _measured_spec(args, refine_seconds)
    missing = [flag for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches)) if value is None]
    if missing:
        raise ScheduleError(f"give {' and '.join(missing)} (or --costs-from FILE, which records them)")
    check_size(args.pp, args.microbatches, args.chunks)
    flags = {
        name: default if getattr(args, name) is None else getattr(args, name) for name, default in _UNIT_COSTS.items()
    }
    for defaults in (_MEMORY, _DATA_PARALLEL):
        flags.update(
            {
                name: default if getattr(args, name) is None else getattr(args, name)
                for name, default in defaults.items()
            }
        )
    costs = CostModel(
        args.pp, **{name.replace("cost_", "t_"): value for name, value in flags.items()}, **_overlap(args)
    )
    return ScheduleSpec(
        args.pp,
        args.microbatches,
        args.chunks,
        costs,
        args.memory_limit,
        refine_seconds,
        getattr(args, "post_validation", False),
        _breadth_first(args, args.microbatches),
        overlap_f_b=_overlap_f_b(args, costs),
    )


def _overlap(args: argparse.Namespace) -> dict:
    """``CostModel.overlap`` where --cost-overlap gives it."""
    return {} if getattr(args, "cost_overlap", None) is None else {"overlap": args.cost_overlap}


def _overlap_f_b(args: argparse.Namespace, costs: CostModel) -> bool:
    """--overlap-f-b, refused where the costs have no all-to-all time to hide (a pair would gain nothing)."""
    asked = getattr(args, "overlap_f_b", False)
    if asked and not costs.has_all_to_all:
        raise ScheduleError(
            "--overlap-f-b hides the expert-parallel all-to-all, and the costs have none: give --cost-a2a (or "
            "--costs-from a run with MoE layers), or drop --overlap-f-b"
        )
    return asked


def _measured_spec(args: argparse.Namespace, refine_seconds: float) -> ScheduleSpec:
    """The setting of a saved profile, with the flags given on top (never mixed with other times)."""
    measured = load_costs(args.costs_from)
    given = [f"--{name.replace('_', '-')}" for name in _UNIT_COSTS if getattr(args, name) is not None]
    if given:
        raise ScheduleError(
            f"{', '.join(given)} and --costs-from {args.costs_from} both give times; drop one "
            "(the file's are measured, in ms per stage)"
        )
    if args.pp is not None and args.pp != measured.costs.pp:
        raise ScheduleError(
            f"--pp {args.pp}: --costs-from {args.costs_from} was measured at pipeline size {measured.costs.pp}; "
            "per-stage costs do not carry over to another pp (drop --pp)"
        )
    microbatches = args.microbatches or measured.microbatches
    if microbatches is None:
        raise ScheduleError(f"give --microbatches: --costs-from {args.costs_from} does not record them")
    check_size(measured.costs.pp, microbatches, args.chunks)
    memory = {name: getattr(args, name) for name in _MEMORY if getattr(args, name) is not None}
    memory.update(
        {name.replace("cost_", "t_"): getattr(args, name) for name in _DATA_PARALLEL if getattr(args, name) is not None}
    )
    costs = replace(measured.costs, **memory, **_overlap(args))
    limit = args.memory_limit if args.memory_limit is not None else measured.memory_limit
    chunks = args.chunks
    if "schedule" in args:  # plan: the run's schedule, with its chunk count, unless another is named
        args.schedule = args.schedule or measured.schedule
        if chunks is None and args.schedule == measured.schedule and measured.chunks != 1:
            chunks = measured.chunks
    return ScheduleSpec(
        costs.pp,
        microbatches,
        chunks,
        costs,
        limit,
        refine_seconds,
        getattr(args, "post_validation", False),
        _breadth_first(args, microbatches),
        overlap_f_b=_overlap_f_b(args, costs),
    )


def plan_schedule(args: argparse.Namespace) -> tuple[Schedule, CostModel]:
    if getattr(args, "from_file", None):
        return _file_schedule(args)
    spec = _spec(args, args.refine_seconds)
    if args.schedule is None:
        raise ScheduleError("give --schedule NAME (see `megatron-zb list`)")
    schedule = build(args.schedule, spec)
    lowering = data_parallel(args)
    if lowering is None:
        return add_all_to_all(schedule, spec.costs), spec.costs
    return lower(schedule, lowering, spec.costs if spec.costs.has_all_to_all else None), spec.costs


def _file_schedule(args: argparse.Namespace) -> tuple[Schedule, CostModel]:
    """The orders of --from-file, validated under the costs and memory limit given."""
    if args.schedule or args.refine_seconds:
        given = "--schedule" if args.schedule else "--refine-seconds"
        raise ScheduleError(f"{given} plans a schedule; --from-file {args.from_file} gives its orders: drop one")
    loaded = load_schedule(args.from_file)
    schedule = loaded.schedule
    asked = {"pp": ("--pp", args.pp), "microbatches": ("--microbatches", args.microbatches)}
    refuse_other_setting(f"--from-file {args.from_file}", schedule, {**asked, "chunks": ("--chunks", args.chunks)})
    args.pp = None if args.costs_from else schedule.pp
    args.microbatches = schedule.microbatches
    spec = _spec(args)
    if spec.costs.pp != schedule.pp:
        raise ScheduleError(f"--costs-from {args.costs_from} is for pp={spec.costs.pp}, the file for pp={schedule.pp}")
    if spec.overlap_f_b and not schedule.overlapped:
        schedule = overlap_pairs(schedule, spec.costs, "stage_span" if spec.post_validation else "makespan")
    check(schedule, spec.costs, spec.memory_limit)
    for note in loaded.notes:
        print(f"megatron-zb plan: note: {args.from_file}: {note}", file=sys.stderr)
    return schedule, spec.costs


def plan_timeline(args: argparse.Namespace) -> Timeline:
    return simulate(*plan_schedule(args))


def render(timeline: Timeline, fmt: str, width: int | None = None, color: bool = False) -> str:
    from . import render as renderers

    if fmt == "json":
        return json.dumps(timeline.to_dict())
    if fmt == "torch-csv":
        return write_torch_csv(timeline.schedule).removesuffix("\n")  # _write and print end the last row
    if fmt == "text":
        return renderers.render_text(timeline, width=width, color=color)
    return renderers.FORMATS[fmt](timeline)


def _check_outputs(args: argparse.Namespace) -> None:
    """-o and --plot are writable (their folders created) before anything is computed."""
    from .training.checks import writable_file  # pure Python, like this module

    if getattr(args, "plot", None):
        _plot_suffix(args.plot)
    for option, path in (("-o/--output", getattr(args, "output", None)), ("--plot", getattr(args, "plot", None))):
        if path:
            try:
                writable_file(option, path)
            except ValueError as error:
                raise ScheduleError(str(error)) from None


def _write(text: str, path: str | None) -> None:
    if not path:
        print(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
    except OSError as error:
        raise ScheduleError(f"-o/--output {path}: cannot write ({error.strerror or error})") from None


def _plot_suffix(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".svg", ".png"):
        raise ScheduleError(f"--plot writes .svg or .png files, got {path!r}")
    return suffix


def _plot(svg: str, path: str) -> None:
    """Write a plot as SVG, or as PNG through rsvg-convert; ScheduleError if that cannot work."""
    if _plot_suffix(path) == ".svg":
        try:
            Path(path).write_text(svg, encoding="utf-8")
        except OSError as error:
            raise ScheduleError(f"--plot {path}: cannot write ({error.strerror or error})") from None
        return
    converter = shutil.which("rsvg-convert")
    if converter is None:
        raise ScheduleError(
            "--plot FILE.png needs rsvg-convert (Debian/Ubuntu: apt-get install librsvg2-bin); "
            "or write an .svg, which needs nothing"
        )
    result = subprocess.run([converter, "-f", "png", "-o", path], input=svg.encode(), capture_output=True)
    if result.returncode:
        raise ScheduleError(f"rsvg-convert failed: {result.stderr.decode(errors='replace').strip()}")


def run_plan(args: argparse.Namespace) -> None:
    if args.iterations == 1:
        if args.post_validation and not (args.schedule and get(args.schedule).composite):
            raise ScheduleError(
                "--post-validation needs --iterations N with N >= 2 (or --schedule auto): it changes only how one "
                "iteration hands over to the next, and which schedule auto picks"
            )
        text = render(plan_timeline(args), args.format, args.width, args.color)
    elif args.format == "torch-csv":
        raise ScheduleError("--format torch-csv writes one iteration's orders; drop --iterations")
    else:
        text = _plan_iterations(args)
    _write(text, args.output)


def _plan_iterations(args: argparse.Namespace) -> str:
    """The iterations drawn one way; text and json give the period both ways, so the gain shows."""
    schedule, costs = plan_schedule(args)
    runs = {pv: simulate_iterations(schedule, costs, args.iterations, pv) for pv in (False, True)}
    drawn = runs[args.post_validation]
    if args.format == "json":
        return json.dumps({**drawn.timeline.to_dict(), "iterations": _iterations_dict(drawn, runs)})
    text = render(drawn.timeline, args.format, args.width, args.color)
    if args.format != "text":
        return text
    synchronous, post_validation = runs[False].period, runs[True].period
    ratio = f" ({post_validation / synchronous:.3g}x)" if synchronous else ""
    return text + "\n".join(
        [
            f"iterations   {drawn.iterations} back to back, drawn with "
            + ("post-validation" if drawn.post_validation else "a synchronising optimizer step"),
            f"period       per iteration: {synchronous:.6g} with a synchronising optimizer step, "
            f"{post_validation:.6g} with post-validation{ratio}",
        ]
    )


def _iterations_dict(drawn: IterationsTimeline, runs: dict[bool, IterationsTimeline]) -> dict:
    return {
        "count": drawn.iterations,
        "post_validation": drawn.post_validation,
        "period": drawn.period,
        "period_synchronous": runs[False].period,
        "period_post_validation": runs[True].period,
    }


def run_compare(args: argparse.Namespace) -> None:
    if args.sweep:
        run_sweep(args)
        return
    comparison = compare(_spec(args), data_parallel(args))
    text = json.dumps(comparison.to_dict()) if args.format == "json" else comparison.to_text().rstrip("\n")
    if args.plot:
        from .render.pareto import render_pareto_svg

        _plot(render_pareto_svg(comparison), args.plot)
    _write(text, args.output)


def run_sweep(args: argparse.Namespace) -> None:
    from .sweep import sweep

    if args.microbatches is not None:
        raise ScheduleError("--sweep gives the microbatch counts; drop --microbatches")
    args.sweep = sorted(set(args.sweep))
    args.microbatches = max(args.sweep)
    spec = _spec(args)
    for m in args.sweep:  # the breadth-first knobs must fit every count
        _breadth_first(args, m)
    lowering = data_parallel(args)
    label = f"pp={spec.pp}" + ("" if spec.chunks is None else f" chunks={spec.chunks}")
    if lowering is not None:
        label += f" data-parallel cost {','.join(f'{v:g}' for v in set(spec.cost_model().t_dp))}"
        label += " ZeRO-3" if lowering.gather == "windows" else ""
    result = sweep(spec, args.sweep, lowering, label)
    text = json.dumps(result.to_dict()) if args.format == "json" else result.to_text().rstrip("\n")
    if args.plot:
        from .render.sweep_svg import render_sweep_svg

        _plot(render_sweep_svg(result), args.plot)
    _write(text, args.output)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``megatron-zb`` command; Ctrl-C at any point ends it with status 130 and one line, no traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("megatron-zb: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from .pretrain_gpt import main as train  # needs torch and megatron-core

        return train(argv[1:])
    if argv[:1] == ["verify"]:
        from .verify import main as verify  # needs torch and megatron-core

        return verify(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in names():
            print(f"{name:20s} {get(name).summary}")
        return 0
    try:
        _check_outputs(args)
        {"plan": run_plan, "compare": run_compare}[args.command](args)
    except ScheduleError as error:
        print(f"megatron-zb {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
