"""The flag table's row: one ``Flag`` says everything megatron-zb knows of one flag, and parsers are built from rows.

A row holds the flag's name, type, default, choices, the range its numbers take (a ``Range``) and why,
its help, who honours it, what a CPU run makes of it and what verify does with it. ``add_to`` adds rows
to an argparse parser, so no parser of megatron-zb spells a flag itself; ``argument_type`` is the
argparse ``type=`` that parses a value and refuses what the row's range excludes (the planner's way),
while the training routes check their numbers after parsing (``checks.check_numbers``), where
Megatron-LM's own parser read them. The rows are in ``zero_bubble.py``, ``launcher.py`` and
``commands.py``. Standard library only.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of finite numbers; ``str`` says it the way a message does."""

    low: float
    high: float = math.inf
    high_open: bool = False  # [low, high) instead of [low, high]
    low_open: bool = False  # (low, ...] instead of [low, ...]

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "finite"
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"

    def counted(self) -> str:
        """The range of a whole number, in words: "at least 1", "between 0 and 4294967295"."""
        low = int(self.low) + (1 if self.low_open else 0)
        if self.high == math.inf:
            return f"at least {low}"
        return f"between {low} and {int(self.high) - (1 if self.high_open else 0)}"


COUNT = Range(1)  # a count of something: 1 or more
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
FINITE = Range(-math.inf)  # any finite number
PROBABILITY = Range(0, 1, high_open=True)  # dropout and Adam's betas: 1 would zero every value / never forget
# Every wait is bounded by one timeout: at least a second (a shorter one fails healthy waits), at most a day
# (longer ones overflow gloo's and the store's millisecond counters, and a stall would go unnamed for days).
TIMEOUT_SECONDS = Range(1, 86400)
TIMEOUT_MINUTES = Range(1 / 60, 1440)

# Who honours a flag.
ZERO_BUBBLE = "zero-bubble"  # megatron_zb.add_args: megatron-zb's schedules, in its own loop and in Megatron-LM's
MEGATRON_LM = "megatron-lm"  # a pretrain_gpt flag of Megatron-LM that megatron-zb's own loop implements too
LAUNCHER = "launcher"  # megatron-zb train's own loop only: Megatron-LM's pretrain_gpt has no such flag
PLANNER = "planner"  # megatron-zb plan and compare (planning only, no training)
VERIFY = "verify"  # megatron-zb verify's own options (the line it checks comes after --)


@dataclass(frozen=True)
class OnCpu:
    """What a CPU run sets a flag to where the line does not give it, and why."""

    value: str | None  # None: the switch is given
    why: str


@dataclass(frozen=True)
class Flag:
    """One flag: how it is parsed, checked, documented, and what a CPU run and verify make of it."""

    option: str  # as written on the command line: --micro-batch-size
    help: str = ""  # may name {fields} of the ``fill`` that ``add_to`` gets (the registered schedules)
    type: Callable[[str], object] | str | None = None  # int, float, str (None: str); a str names one of ``types``
    default: object = None
    switch: bool = False  # takes no value: given or not (store_false where the default is True)
    choices: tuple | None = None
    metavar: str | None = None
    nargs: str | None = None
    const: object = None  # the value of an optional value given without one (nargs "?")
    dest: str | None = None  # Megatron-LM's destination where it is not the option's own name
    required: bool = False
    aliases: tuple[str, ...] = ()  # other spellings: -m, -o
    group: str = ""  # the argument group that lists it ("": the parser's own options)
    honoured: str = MEGATRON_LM  # who honours it: ZERO_BUBBLE, MEGATRON_LM, LAUNCHER, PLANNER or VERIFY
    range: Range | None = None  # the numbers it takes: checked once, after parsing or by ``argument_type``
    why: str | None = None  # what the range means, said in the refusal: "(samples per microbatch)"
    refusal: str | None = None  # the refusal where the usual one says too little ({option}, {value}, {range})
    checked_when_parsed: bool = False  # its range is checked while parsing, in every parser that has it
    refused_values: tuple[tuple[str, str], ...] = ()  # values refused while parsing, each with its reason
    comma_list: bool = False  # a comma list of values (one per pipeline stage)
    needs_schedule: bool = False  # changes nothing without a megatron-zb schedule: refused there
    excludes: tuple[tuple[str, str], ...] = ()  # flags refused with it (their fields), each with why
    on_cpu: OnCpu | None = None  # what a CPU run sets it to (Megatron-LM's pretrain(), verify's scaled copy)
    verify: str | None = None  # why verify's scaled copy changes it, drops it or refuses it ({value}: the line's)
    differs: str | None = None  # where it differs on purpose from Megatron-LM's flag of the same name, and why

    @property
    def name(self) -> str:
        """The parsed namespace's field."""
        return self.dest or self.option.lstrip("-").replace("-", "_")

    @property
    def options(self) -> tuple[str, ...]:
        return (self.option, *self.aliases)

    @property
    def reason(self) -> str:
        """What the range means, as a refusal says it after the range."""
        return f" ({self.why})" if self.why else ""

    def help_text(self, fill: Mapping[str, str] | None = None) -> str:
        return self.help.format_map(fill) if fill else self.help

    def out_of_range(self, value: object) -> str:
        """The refusal of a value outside ``range``: it names the flag, the range, what it means, and the value."""
        if self.refusal:
            return self.refusal.format(option=self.option, value=value, range=self.range)
        if self.type is int:
            return f"{self.option} must be {self.range.counted()}{self.reason}, got {value}"
        return f"{self.option} must be a finite number {self.range}{self.reason}, got {value}"


def add_to(
    parser: argparse.ArgumentParser,
    rows: Iterable[Flag],
    *,
    types: Mapping[str, Callable[[str], object]] | None = None,
    fill: Mapping[str, str] | None = None,
    checked: bool = False,
) -> argparse.ArgumentParser:
    """Add ``rows`` to ``parser``, each in its argument group (made on its first row), in the order given.

    ``types`` resolves the rows whose type is a name, ``fill`` the {fields} of their help; ``checked``
    gives every number row an ``argument_type`` that refuses what its range excludes while parsing.
    """
    groups: dict[str, argparse._ActionsContainer] = {}
    for row in rows:
        if row.group not in groups:
            groups[row.group] = parser.add_argument_group(row.group) if row.group else parser
        groups[row.group].add_argument(*row.options, **_argparse_keywords(row, types or {}, fill, checked))
    return parser


def _argparse_keywords(row: Flag, types: Mapping, fill: Mapping | None, checked: bool) -> dict:
    keywords = {"help": row.help_text(fill) or None}
    if row.dest:
        keywords["dest"] = row.dest
    if row.switch:
        keywords["action"] = "store_false" if row.default is True else "store_true"
        return keywords
    parse = types[row.type] if isinstance(row.type, str) else row.type
    if row.type in (int, float) and (checked or row.checked_when_parsed):
        parse = argument_type(row)
    keywords.update(type=parse, default=row.default)
    for field in ("choices", "metavar", "nargs", "const"):
        if getattr(row, field) is not None:
            keywords[field] = getattr(row, field)
    if row.required:
        keywords["required"] = True
    return {key: value for key, value in keywords.items() if value is not None or key == "default"}


@functools.cache
def argument_type(row: Flag) -> Callable[[str], object]:
    """The argparse ``type=`` of a number row: parses it (each item of a comma list), refuses non-finite numbers
    and values outside the row's range; argparse names the option in front of the message. One per row, so that
    every parser a row is added to has the same type."""

    def parse(text: str):
        refused = dict(row.refused_values)
        if text in refused:
            raise argparse.ArgumentTypeError(refused[text])
        values = tuple(_number(row, item, text) for item in (text.split(",") if row.comma_list else [text]))
        return values if row.comma_list else values[0]

    return parse


def _number(row: Flag, item: str, text: str) -> float | int:
    """One number of ``text``; the messages say a whole number's range in words ("at least 1")."""
    whole, several = row.type is int, row.comma_list and row.type is float
    try:
        value = row.type(item)
    except ValueError:
        if whole:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {item!r}") from None
        what = "a number or a comma list of numbers" if several else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        what = "finite numbers" if several else "a finite number"
        raise argparse.ArgumentTypeError(f"expected {what} (no nan or inf), got {text!r}")
    if row.range is not None and value not in row.range:
        bound, given = (row.range.counted(), value) if whole else (str(row.range), item)
        raise argparse.ArgumentTypeError(f"must be {bound}{row.reason}, got {given}")
    return value
