"""The ``megatron-zb`` command: plan, simulate and draw schedules (no torch needed)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .schedule.costs import CostModel
from .schedule.ir import ScheduleError
from .schedule.registry import ScheduleSpec, build, get, names
from .schedule.simulate import Timeline, simulate

FORMATS = ("text", "json", "svg", "html", "chrome-trace")


def _numbers(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma list of numbers, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", required=True, help="schedule name; see `megatron-zb list`")
    parser.add_argument("--pp", type=_positive_int, required=True, help="pipeline-parallel ranks")
    parser.add_argument("--microbatches", "-m", type=_positive_int, required=True, help="microbatches per iteration")
    parser.add_argument("--chunks", type=_positive_int, help="model chunks per rank (interleaved schedules)")
    costs = parser.add_argument_group("costs, per full stage (a number, or a comma list with one value per stage)")
    costs.add_argument("--cost-f", type=_numbers, default=(1.0,), help="forward time T_F (default 1)")
    costs.add_argument("--cost-b", type=_numbers, default=(1.0,), help="input-gradient backward time T_B (default 1)")
    costs.add_argument("--cost-w", type=_numbers, default=(1.0,), help="weight-gradient backward time T_W (default 1)")
    costs.add_argument("--cost-comm", type=float, default=0.0, help="latency per cross-rank transfer (default 0)")
    memory = parser.add_argument_group("memory, in one microbatch's activations of a full stage")
    memory.add_argument("--mem-f", type=_numbers, default=(1.0,), help="allocated by F (default 1)")
    memory.add_argument("--mem-b", type=_numbers, default=(-0.5,), help="freed by B, negative (default -0.5)")
    memory.add_argument("--mem-w", type=_numbers, default=(-0.5,), help="freed by W, negative (default -0.5)")
    memory.add_argument("--memory-limit", type=float, help="per-rank activation memory limit (default: none)")
    out = parser.add_argument_group("output")
    out.add_argument("--format", choices=FORMATS, default="text", help="default: text")
    out.add_argument("-o", "--output", help="write to this file instead of standard output")
    out.add_argument("--width", type=int, help="text format: at most this many columns for the timeline")
    out.add_argument("--color", action="store_true", help="text format: ANSI colors by pass kind")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-zb", description="Zero-bubble pipeline schedules for Megatron.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="generate, validate, simulate and draw one schedule")
    _add_plan_args(plan)
    commands.add_parser("list", help="the registered schedules, one line each")
    return parser


def plan_timeline(args: argparse.Namespace) -> Timeline:
    costs = CostModel(
        args.pp,
        t_f=args.cost_f,
        t_b=args.cost_b,
        t_w=args.cost_w,
        t_comm=args.cost_comm,
        mem_f=args.mem_f,
        mem_b=args.mem_b,
        mem_w=args.mem_w,
    )
    spec = ScheduleSpec(args.pp, args.microbatches, args.chunks, costs, args.memory_limit)
    return simulate(build(args.schedule, spec), costs)


def render(timeline: Timeline, fmt: str, width: int | None = None, color: bool = False) -> str:
    from . import render as renderers

    if fmt == "json":
        return json.dumps(timeline.to_dict())
    if fmt == "text":
        return renderers.render_text(timeline, width=width, color=color)
    return renderers.FORMATS[fmt](timeline)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in names():
            print(f"{name:20s} {get(name).summary}")
        return 0
    try:
        text = render(plan_timeline(args), args.format, args.width, args.color)
    except ScheduleError as error:
        print(f"megatron-zb plan: error: {error}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
