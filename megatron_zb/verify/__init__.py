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
from collections.abc import Sequence

from ..checks import check_numbers
from ..flags.commands import VERIFY_FLAGS
from ..flags.table import add_to
from . import megatron_lm_route
from .megatron_lm_route import LINE_REFUSED, PROG
from .verdict import check_tolerance

__all__ = ["LINE_REFUSED", "PROG", "build_parser", "main", "split_argv"]


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
        return megatron_lm_route.run(options, user)
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
