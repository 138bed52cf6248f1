"""``megatron-zb verify``: your pretrain_gpt command line, scaled down and checked on CPU before GPU hours.

``megatron-zb verify [--megatron-lm PATH] [--verify-*] -- <your exact pretrain_gpt argv>``

Where Megatron-LM's training package is importable (a checkout given with ``--megatron-lm``, or
the ``megatron.training`` that megatron-core 0.17+ wheels ship), the line is read with Megatron-LM's
own parser, scaled down flag by flag (``scale``: every change printed with its reason) and trained
twice through Megatron-LM's own ``pretrain()`` on gloo processes: megatron-core's own schedule, then
the line's zero-bubble schedule. Losses and grad norms are compared per iteration (``verdict``).
Without Megatron-LM, megatron-zb's own training loop runs both (``own_loop``), on the flags it knows.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..checks import check_numbers
from ..flags.commands import VERIFY_FLAGS
from ..flags.table import add_to
from . import scale
from .verdict import TOLERANCE, Run, check_tolerance, compare, report

PROG = "megatron-zb verify"
LINE_REFUSED = "your line, before any scaling: {error}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--megatron-lm [PATH]] [--verify-* ...] -- <your pretrain_gpt flags>",
        description="Train a scaled-down copy of your pretrain_gpt command line on CPU with megatron-core's schedule "
        "and with yours; exit 1 when losses or grad norms differ, 2 when the line cannot be checked.",
    )
    return add_to(parser, VERIFY_FLAGS)


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """(verify's flags, the user's line after ``--``; None without ``--``)."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, None


def main(argv: Sequence[str] | None = None, inject_wrong_gradient_at: int | None = None) -> int:
    """0 when both runs agree, 1 on a mismatch or a failed run, 2 when the line cannot be checked.

    ``inject_wrong_gradient_at`` (tests only, megatron-zb's own loop) scales one gradient of their
    run at that iteration, to show that a wrong gradient is caught.
    """
    parser = build_parser()
    mine, user = split_argv(sys.argv[1:] if argv is None else argv)
    if user is None:
        options, user = parser.parse_known_args(mine)
    else:
        options = parser.parse_args(mine)
    try:
        _check_options(options)
        loop = _loop(options)
        if loop == "launcher":
            return _own_loop(options, user, inject_wrong_gradient_at)
        return _megatron_lm(options, user)
    except ValueError as error:
        parser.exit(2, f"{PROG}: error: {error}\n")


def _check_options(options: argparse.Namespace) -> None:
    check_numbers(options, VERIFY_FLAGS)
    check_tolerance(options.verify_tolerance)
    if options.megatron_lm and not os.path.isdir(options.megatron_lm):
        raise ValueError(f"--megatron-lm {options.megatron_lm}: not a directory (give a Megatron-LM checkout)")
    if options.megatron_lm is not None and options.verify_loop == "launcher":
        raise ValueError("--megatron-lm runs Megatron-LM's pretrain(); drop it or --verify-loop launcher")


def _loop(options: argparse.Namespace) -> str:
    """Megatron-LM's loop where it can be imported, megatron-zb's otherwise (or as asked)."""
    if options.megatron_lm:
        os.environ["MEGATRON_LM_PATH"] = os.path.abspath(options.megatron_lm)
        sys.path.insert(0, os.environ["MEGATRON_LM_PATH"])
    if options.verify_loop is not None:
        return options.verify_loop
    from ..flags.megatron_lm_parser import megatron_lm_parser

    return "megatron-lm" if megatron_lm_parser() is not None else "launcher"


def _own_loop(options: argparse.Namespace, user: list[str], inject: int | None) -> int:
    from ..training import flag_surface
    from ..training.arguments import build_parser as train_parser
    from . import own_loop

    train = train_parser()
    train.prog = PROG
    for note in flag_surface.check(user, train):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    return own_loop.verify(train.parse_args(flag_surface.without_no_effect_flags(user, train)), options, inject)


def _megatron_lm(options: argparse.Namespace, user: list[str]) -> int:
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
    tolerance = options.verify_tolerance if options.verify_tolerance is not None else TOLERANCE[line.precision]
    verdict = compare(reference, theirs, tolerance)
    print(report(verdict, reference, theirs, line.schedule, tolerance))
    return 0 if verdict.passed else 1


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
    problem = refuse_unknown(flags, stray, f"Megatron-LM {megatron_lm_version()}'s pretrain_gpt")
    if problem:
        raise ValueError(problem)
    args = preflight.parse_line(parser, user)
    for note in zero_bubble_notes(args):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    if own_providers and refused_features(args):
        raise ValueError(
            f"{', '.join(refused_features(args))}: megatron-zb's GPT providers (used without a Megatron-LM checkout) "
            "do not implement this; give your checkout with --megatron-lm PATH"
        )
    try:
        scale.refuse(args)
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
