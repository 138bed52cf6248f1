"""verify through Megatron-LM's own ``pretrain()``: the line read by Megatron-LM's parser, scaled, run twice, compared.

The line is refused before any process starts when Megatron-LM's parser or ``validate_args`` would refuse it at
full size or scaled (``preflight``); each run is Megatron-LM's ``pretrain()`` on gloo processes
(``megatron_lm.verify_runs``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from . import scale
from .verdict import TOLERANCE, Run, compare, report

PROG = "megatron-zb verify"
LINE_REFUSED = "your line, before any scaling: {error}"


def run(options: argparse.Namespace, user: list[str]) -> int:
    """Both runs of the scaled line through Megatron-LM's pretrain(), compared: 0 when they agree, 1 otherwise."""
    from ..flags.megatron_lm_parser import megatron_lm_parser, megatron_lm_version
    from ..megatron.args import add_args
    from ..megatron_lm import preflight
    from ..megatron_lm import verify_runs as megatron_lm_runs
    from ..megatron_lm.checkout import uses_own_providers

    parser = megatron_lm_parser(add_args)
    if parser is None:
        raise ValueError("--verify-loop megatron-lm needs Megatron-LM's megatron.training (megatron-core >= 0.17, or "
                         "a checkout with --megatron-lm PATH)")  # fmt: skip
    own = uses_own_providers()
    unset = preflight.unset_te_attention()
    if unset:
        print(f"{PROG}: on CPU: {unset}", flush=True)
    with tempfile.TemporaryDirectory(prefix="megatron-zb-verify-") as folder:
        limits = scale.Limits(options.verify_iters, options.verify_data_parallel, Path(folder))
        line, timeout_s = _scaled_line(parser, user, limits, own)
        where = "megatron-zb's GPT providers on the installed megatron.training" if own else "your checkout's scripts"
        print(
            f"{PROG}: {line.schedule} against megatron-core's own schedule, through Megatron-LM "
            f"{megatron_lm_version()}'s pretrain() ({where}), {line.processes} gloo processes, "
            f"{options.verify_iters} iterations, {line.precision}; your line, scaled down:",
            flush=True,
        )
        print(line.table(), flush=True)
        try:
            runs = [("reference", "megatron-core's own schedule", line.reference_argv)]
            runs.append(("zero-bubble", line.schedule, line.argv))
            reference, theirs = (
                _train(megatron_lm_runs, argv, line.processes, name, label, Path(folder), timeout_s)
                for name, label, argv in runs
            )
        except megatron_lm_runs.RunFailed as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            return 1
        replan = replan_outcome(Path(folder) / "zero-bubble.log")
    tolerance = options.verify_tolerance if options.verify_tolerance is not None else TOLERANCE[line.precision]
    verdict = compare(reference, theirs, tolerance)
    print(report(verdict, reference, theirs, line.schedule, tolerance, replan=replan))
    return 0 if verdict.passed else 1


REPLAN_LOGGER = "megatron_zb.replan:"  # the re-plan's one line, as rank 0 logs it


def replan_outcome(log: Path) -> str | None:
    """What the zero-bubble run's re-plan did, short (pairs placed, or the schedule kept and why); None where the
    run re-planned nothing (its timed iterations lie beyond the scaled run's)."""
    said = [line.split(REPLAN_LOGGER, 1)[1] for line in _lines(log) if REPLAN_LOGGER in line]
    said = [line for line in said if line.startswith(("re-planned ", "kept "))]
    if not said:
        return None
    if said[0].startswith("re-planned "):
        head = said[0].split(" from the ", 1)[0]
        return head if " overlapped F&B pairs" in head else f"{head}, no overlapped F&B pair shortening its iteration"
    kept, _, why = said[0].partition(" after the ")
    return f"the re-plan {kept}, without overlapped F&B pairs ({why.rsplit(': ', 1)[-1]})"


def _lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.exists() else []


def _train(runs, argv: list[str], processes: int, name: str, label: str, folder: Path, timeout_s: float):
    """One run (``megatron_lm_runs.train``), its time printed under ``label``: what it logged."""
    logged, seconds = runs.train(argv, processes, name, folder, timeout_s, label)
    print(f"{label}: trained in {seconds:.0f} s", flush=True)
    return Run.from_metrics(logged)


def _scaled_line(parser, user: list[str], limits, own_providers: bool):
    """(the scaled line, its timeout in seconds): read, refused, validated at full size, scaled, validated again."""
    from ..flags.megatron_lm_parser import given_flags, megatron_lm_version, refuse_unknown
    from ..megatron.args import schedule_settings, zero_bubble_notes
    from ..megatron_lm import preflight
    from ..megatron_lm.script import refused_features

    flags, stray = given_flags(parser, user)
    problem = preflight.modelopt_flags(flags) or refuse_unknown(
        flags, stray, f"Megatron-LM {megatron_lm_version()}'s pretrain_gpt"
    )
    if problem:
        raise ValueError(problem)
    args = preflight.parse_line(parser, user)
    for note in zero_bubble_notes(args):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    try:
        scale.refuse(args)  # what a CPU cannot run comes first: no checkout runs it here either
    except ValueError as error:
        raise ValueError(LINE_REFUSED.format(error=error)) from None
    if own_providers and refused_features(args):
        raise ValueError(
            f"{', '.join(refused_features(args))}: megatron-zb's GPT providers (used without a Megatron-LM checkout) "
            "do not implement this; give your checkout with --megatron-lm PATH"
        )
    try:
        processes = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
        preflight.validate(parser, scale.on_cpu(parser, flags, args), processes)
    except ValueError as error:
        raise ValueError(LINE_REFUSED.format(error=error)) from None
    try:
        line = scale.scale(parser, flags, args, limits, schedule_settings)
    except scale.Refused as error:
        raise ValueError(str(error)) from None
    for name, argv in (("reference", line.reference_argv), (line.schedule, line.argv)):
        try:
            minutes = preflight.validate(parser, argv, line.processes).distributed_timeout_minutes
        except ValueError as error:
            raise ValueError(f"the scaled copy ({name} run): {error}") from None
    return line, 60.0 * minutes
