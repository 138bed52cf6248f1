"""Every flag megatron-zb defines is a row of the flag table (``megatron_zb/flags/``), once.

The parsers are built from the rows (``flags.table.add_to``), so a flag written into a parser by hand
(an ``add_argument`` call with the option as a literal) is a second description that the checks,
verify and docs/flags.md do not see: the scan below fails on one. One command's rows name each option
once; two commands may each have their own flag of one name (plan's and compare's ``--format``).
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_zb.flags.commands import COMMANDS
from megatron_zb.flags.table import Flag, add_to
from megatron_zb.megatron.args import add_args, help_fill
from megatron_zb.training.arguments import build_parser

PACKAGE = Path(__file__).parents[1] / "megatron_zb"
# Modules that still spell flags themselves, each with why (to move into the table by whoever owns them).
NOT_YET: dict[str, str] = {}


def literal_flags(path: Path) -> list[str]:
    """``add_argument`` calls in ``path`` whose option is a string literal: "line: option"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                    found.append(f"{node.lineno}: {arg.value}")
    return found


def test_no_module_defines_a_flag_outside_the_table() -> None:
    outside = {
        str(path.relative_to(PACKAGE)): flags
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in NOT_YET and (flags := literal_flags(path))
    }
    assert not outside, f"flags defined outside the flag table (give them a row in megatron_zb/flags/): {outside}"


def test_the_scan_finds_a_literal_flag(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text('parser.add_argument("--foo", type=int)\nparser.add_argument(*row.options)\n')
    assert literal_flags(module) == ["1: --foo"]


def test_the_modules_not_yet_moved_still_spell_flags() -> None:
    """A module that no longer spells a flag leaves NOT_YET, so that the scan covers it again."""
    assert all(literal_flags(PACKAGE / name) for name in NOT_YET)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_defines_each_flag_once(command: str) -> None:
    seen: dict[str, Flag] = {}
    for row in COMMANDS[command]:
        for option in row.options:
            assert option not in seen, f"{command}: {option} defined in two rows: {seen[option]} and {row}"
            seen[option] = row


def test_a_flag_in_two_commands_is_one_row_unless_they_differ_on_purpose() -> None:
    """The same option in two commands is one row (listed in another group, perhaps), but for two that differ:
    plan writes more --format's than compare, and verify's --megatron-lm takes the checkout's PATH."""
    rows: dict[str, set[Flag]] = {}
    for command_rows in COMMANDS.values():
        for row in command_rows:
            rows.setdefault(row.option, set()).add(replace(row, group="", honoured=""))
    assert {option for option, defined in rows.items() if len(defined) > 1} == {"--format", "--megatron-lm"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_builds_and_its_help_fills(command: str) -> None:
    parser = add_to(argparse.ArgumentParser(add_help=False), COMMANDS[command], types={"schedule": str},
                    fill=help_fill(), checked=command in ("plan", "compare"))  # fmt: skip
    parser.format_help()  # argparse %-formats every help
    for row in COMMANDS[command]:
        assert "{" not in row.help_text(help_fill()), f"{row.option}: an unfilled field in its help"


def test_the_training_parsers_are_the_rows() -> None:
    ours = {option for row in COMMANDS["train"] for option in row.options}
    assert set(build_parser()._option_string_actions) - {"-h", "--help"} == ours
    zero_bubble = add_args(argparse.ArgumentParser(add_help=False))
    assert set(zero_bubble._option_string_actions) == {row.option for row in COMMANDS["add_args"]}


def test_a_range_is_a_number_rows() -> None:
    rows = {row for command_rows in COMMANDS.values() for row in command_rows}
    assert [row.option for row in rows if row.range is not None and row.type not in (int, float)] == []
    assert [row.option for row in rows if (row.why or row.refusal) and row.range is None] == []


def test_a_number_row_says_its_range_in_its_refusals() -> None:
    from megatron_zb.checks import check_numbers, row

    with pytest.raises(ValueError, match=r"^--seed must be between 0 and 4294967295, got -1$"):
        check_numbers(argparse.Namespace(seed=-1), [row("seed")])
    with pytest.raises(ValueError, match=r"^--lr must be a finite number >= 0 \(0 keeps the weights fixed\), got nan"):
        check_numbers(argparse.Namespace(lr=float("nan")), [row("lr")])
    check_numbers(argparse.Namespace(lr=None, seed=0), [row("lr"), row("seed")])  # None: not given
