"""The launcher's command line on Megatron-LM's flag surface: every pretrain_gpt flag known, each taken or refused.

Where Megatron-LM's parser can be imported (megatron-core 0.17+ wheels ship ``megatron.training``; a
checkout on the path), a ``megatron-zb train`` line is read with it first, plus megatron-zb's flags:

- a flag Megatron-LM does not know is refused, every one of them in one message;
- a Megatron-LM flag that megatron-zb's own training loop does not implement is refused by name, every
  one in one message, pointing at ``--megatron-lm`` (Megatron-LM's own ``pretrain()``, which runs them all);
- the rest are the launcher's flags, which share Megatron-LM's names, types and defaults (a test holds
  them to it), so the launcher's own parser then reads them.

Without Megatron-LM the launcher's parser is the whole surface; the flags it does not know are refused
in one message that says how to get all of Megatron-LM's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..flags.launcher import LAUNCHER_FLAGS
from ..flags.megatron_lm_parser import given_flags, megatron_lm_parser, megatron_lm_version, refuse_unknown
from ..flags.table import LAUNCHER

# The launcher's own flags, which Megatron-LM's pretrain_gpt does not have (the table's LAUNCHER rows).
LAUNCHER_ONLY = tuple(row.option for row in LAUNCHER_FLAGS if row.honoured == LAUNCHER)
# Where the launcher's flag differs from Megatron-LM's on purpose (option -> why); everything else matches.
DIFFERENCES = {row.option: row.differs for row in LAUNCHER_FLAGS if row.differs}
# Megatron-LM flags the launcher takes although it has no option of its own for them: what they do here.
NO_EFFECT = {
    "--use-mcore-models": "the launcher always builds megatron-core's GPTModel",
}
TO_MEGATRON_LM = (
    "megatron-zb's own training loop does not implement {listed}; run the line through Megatron-LM's own pretrain() "
    "with --megatron-lm (every pretrain_gpt flag, same schedules; no checkout needed with megatron-core >= 0.17), "
    "or drop {them}"
)


def check(argv: Sequence[str], launcher: argparse.ArgumentParser) -> list[str]:
    """Refuse (ValueError) what the launcher cannot take; notes for flags taken without an effect here."""
    from ..megatron.args import add_args

    parser = megatron_lm_parser(add_args, _launcher_only(launcher))
    if parser is None:
        return _without_megatron_lm(argv, launcher)
    flags, stray = given_flags(parser, argv)
    problem = refuse_unknown(flags, stray, f"Megatron-LM {megatron_lm_version()}'s pretrain_gpt")
    if problem:
        raise ValueError(problem)
    ours = launcher._option_string_actions
    missing = [given for given in flags if given.flag not in ours and given.flag not in NO_EFFECT]
    if missing:
        listed = ", ".join(str(given) for given in missing)
        raise ValueError(TO_MEGATRON_LM.format(listed=listed, them="it" if len(missing) == 1 else "them"))
    return [f"{given.flag}: no effect here: {NO_EFFECT[given.flag]}" for given in flags if given.flag in NO_EFFECT]


def without_no_effect_flags(argv: Sequence[str], launcher: argparse.ArgumentParser) -> list[str]:
    """``argv`` less the flags of ``NO_EFFECT`` (which the launcher's own parser does not have)."""
    flags, _ = given_flags(launcher, argv)
    return [token for given in flags if given.flag not in NO_EFFECT for token in given.tokens]


def _without_megatron_lm(argv: Sequence[str], launcher: argparse.ArgumentParser) -> list[str]:
    flags, stray = given_flags(launcher, argv)
    unknown = [given for given in flags if given.action is None and given.flag not in NO_EFFECT]
    problem = refuse_unknown(unknown, stray, "megatron-zb's launcher")
    if problem:
        raise ValueError(
            f"{problem}. Without Megatron-LM's training package the launcher knows only its own subset of "
            "pretrain_gpt's flags; with megatron-core >= 0.17 (which ships megatron.training) or a Megatron-LM "
            "checkout (--megatron-lm PATH) every pretrain_gpt flag is read with Megatron-LM's own parser"
        )
    return [f"{given.flag}: no effect here: {NO_EFFECT[given.flag]}" for given in flags if given.flag in NO_EFFECT]


def _launcher_only(launcher: argparse.ArgumentParser):
    """Megatron-LM's parser plus the launcher's own flags (those Megatron-LM lacks), as the launcher declares them."""

    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for action in launcher._actions:
            options = [option for option in action.option_strings if option in LAUNCHER_ONLY]
            if options and not any(option in parser._option_string_actions for option in options):
                kwargs = {"dest": action.dest, "default": action.default}
                if action.nargs == 0:
                    parser.add_argument(*options, action="store_true", **kwargs)
                else:
                    parser.add_argument(*options, nargs=action.nargs, **kwargs)
        return parser

    return add


def honoured(launcher: argparse.ArgumentParser) -> list[str]:
    """The pretrain_gpt flags the launcher implements (its options that are not its own)."""
    return sorted(option for option in launcher._option_string_actions if option.startswith("--")
                  and option not in LAUNCHER_ONLY and option != "--help")  # fmt: skip
