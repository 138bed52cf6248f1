"""Megatron-LM's own flag surface: its parser, and the flags a command line gives, in order.

Where Megatron-LM's training package can be imported (a checkout on the path, or a megatron-core
0.17+ wheel, which ships ``megatron.training``), a pretrain_gpt command line is read with
Megatron-LM's own parser plus megatron-zb's flags: every flag of that version is known by
construction and means what it means there. ``given_flags`` walks a command line flag by flag, so
that callers can account for each one (take it, map it with a printed line, or refuse it by name)
and rewrite the line, instead of letting a flag pass unseen.
"""

from __future__ import annotations

import argparse
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ExtraArgs = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
_NUMBER = re.compile(r"^-\d|^-\.\d")


def megatron_lm_parser(*extra: ExtraArgs) -> argparse.ArgumentParser | None:
    """Megatron-LM's pretrain_gpt parser with ``extra`` flags added; None where ``megatron.training`` is missing."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found", on import
    try:
        with warnings.catch_warnings():  # "Apex is not installed" and the like: the ranks say it if it matters
            warnings.simplefilter("ignore")
            from megatron.training import arguments
    except ImportError:
        return None
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    arguments.add_megatron_arguments(parser)
    for add in extra:
        add(parser)
    return parser


def megatron_lm_version() -> str:
    """The version of the Megatron-LM whose parser is in use (megatron-core's, which ships or pairs with it)."""
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return "unknown"
    return __version__


@dataclass(frozen=True)
class Given:
    """One flag of a command line: as written, its values, and its parser action (None: unknown)."""

    flag: str
    values: tuple[str, ...]
    action: argparse.Action | None
    joined: bool = False  # written --flag=value (a value that starts with "-" needs it)

    @property
    def dest(self) -> str | None:
        return self.action.dest if self.action is not None else None

    @property
    def tokens(self) -> list[str]:
        if self.joined:
            return [f"{self.flag}={self.values[0]}"]
        return [self.flag, *self.values]

    def __str__(self) -> str:
        return " ".join([self.flag, *(_quoted(value) for value in self.values)])


def _quoted(value: str) -> str:
    return repr(value) if not value or any(c.isspace() for c in value) else value


@dataclass(frozen=True)
class Stray:
    """A token that belongs to no flag, and the flag before it (None at the start of the line)."""

    token: str
    after: Given | None


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[Given], list[Stray]]:
    """(each flag of ``argv`` in order, the tokens that belong to no flag).

    Values are counted from each action's ``nargs`` as argparse would; ``--flag=value`` is one flag
    with one value. An unknown flag takes the tokens up to the next flag as its values.
    """
    found, stray, index, argv = [], [], 0, list(argv)
    while index < len(argv):
        token = argv[index]
        if not _is_flag(token):
            stray.append(Stray(token, found[-1] if found else None))
            index += 1
            continue
        flag, _, inline = token.partition("=")
        action = parser._option_string_actions.get(flag)
        if "=" in token:
            found.append(Given(flag, (inline,), action, joined=True))
            index += 1
            continue
        count = _value_count(action, argv, index + 1)
        found.append(Given(flag, tuple(argv[index + 1 : index + 1 + count]), action))
        index += 1 + count
    return found, stray


def _is_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.match(token)


def _value_count(action: argparse.Action | None, argv: list[str], start: int) -> int:
    following = 0
    while start + following < len(argv) and not _is_flag(argv[start + following]):
        following += 1
    if action is None:
        return following
    nargs = action.nargs
    if nargs is None:
        return min(1, following)
    if nargs == argparse.OPTIONAL:
        return min(1, following)
    if nargs in (argparse.ZERO_OR_MORE, argparse.ONE_OR_MORE):
        return following
    if isinstance(nargs, int):
        return min(nargs, following)
    return 0


def unknown_flags(flags: Sequence[Given]) -> list[Given]:
    return [given for given in flags if given.action is None]


def flag_of(action: argparse.Action) -> str:
    """The long option of an action (what error messages name)."""
    longs = [option for option in action.option_strings if option.startswith("--")]
    return (longs or list(action.option_strings) or [action.dest])[0]


def argv_of(flags: Sequence[Given]) -> list[str]:
    return [token for given in flags for token in given.tokens]


def refuse_unknown(flags: Sequence[Given], stray: Sequence[Stray], where: str) -> str | None:
    """One message naming every flag ``where`` does not know and every value that follows no flag; None if none."""
    parts = []
    unknown = unknown_flags(flags)
    if unknown:
        listed = ", ".join(str(given) for given in unknown)
        parts.append(f"{len(unknown)} flag{'s' if len(unknown) > 1 else ''} that {where} does not know: {listed}")
    if stray:
        after = stray[0].after
        hint = ""
        if after is not None and after.action is not None:
            hint = (
                f" ({after.flag} takes {_takes(after.action)}: was a quoted value split by the shell? quote the array "
                'expansions of your script, "${ARRAY[@]}")'
            )
        parts.append(f"values that follow no flag, which {where} refuses: {' '.join(s.token for s in stray)}{hint}")
    return "; ".join(parts) or None


def _takes(action: argparse.Action) -> str:
    return {None: "one value", 0: "no value", "?": "at most one value"}.get(action.nargs, f"{action.nargs} values")
