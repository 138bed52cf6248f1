"""Write docs/flags.md, the flags reference, from the argument parsers themselves (no torch needed).

    python scripts/gen_flags_doc.py            # rewrite docs/flags.md
    python scripts/gen_flags_doc.py --check    # exit 1 if docs/flags.md is out of date

Three tables: the zero-bubble group that ``megatron_zb.add_args`` adds to any Megatron-LM
parser, the flags only ``megatron-zb train`` has, and the Megatron-LM flags that
``megatron-zb train`` accepts. tests/docs/test_flags_doc.py fails when docs/flags.md differs
from what this script writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import megatron_zb
from megatron_zb.training.arguments import build_parser

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "flags.md"
COMMAND = "python scripts/gen_flags_doc.py"
LAUNCHER_GROUP = "launcher (megatron-zb)"


def add_args_parser() -> argparse.ArgumentParser:
    """A bare parser with only what ``megatron_zb.add_args`` adds (the Megatron-LM extra_args_provider)."""
    return megatron_zb.add_args(argparse.ArgumentParser(add_help=False))


def group_actions(parser: argparse.ArgumentParser, title: str) -> list[argparse.Action]:
    for group in parser._action_groups:
        if group.title == title:
            return [action for action in group._group_actions if action.default != argparse.SUPPRESS]  # not -h
    raise KeyError(f"no argument group {title!r} in {parser.prog}")


def _value(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _argument(action: argparse.Action) -> str:
    """What follows the flag on the command line: its metavar, else its type; empty for a switch."""
    if action.nargs == 0:
        return ""
    if action.metavar:
        text = str(action.metavar)
    elif action.type in (int, float, str, None):
        text = (action.type or str).__name__
    else:
        text = "VALUE"
    return f"{text} ..." if action.nargs in ("*", "+") else text


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(actions: list[argparse.Action]) -> list[str]:
    """One Markdown row per flag: flag, argument, default, choices, help."""
    lines = ["| flag | argument | default | choices | help |", "|---|---|---|---|---|"]
    for action in actions:
        flags = ", ".join(f"`{option}`" for option in action.option_strings)
        # a switch is off unless given, whatever it stores (--disable-bias-linear stores False)
        default = "off" if action.nargs == 0 and isinstance(action.default, bool) else _value(action.default)
        if action.required:
            default = "required"
        choices = ", ".join(f"`{choice}`" for choice in action.choices) if action.choices else ""
        argument = f"`{_argument(action)}`" if _argument(action) else ""
        lines.append(f"| {flags} | {argument} | {default} | {choices} | {_cell(action.help or '')} |")
    return lines


def nonempty_groups(parser: argparse.ArgumentParser) -> list[str]:
    return [group.title for group in parser._action_groups if group_actions(parser, group.title)]


def render() -> str:
    """The whole of docs/flags.md."""
    ours, launcher = add_args_parser(), build_parser()
    our_groups = nonempty_groups(ours)
    megatron_groups = [title for title in nonempty_groups(launcher) if title not in {*our_groups, LAUNCHER_GROUP}]
    lines = [
        "# Flags reference",
        "",
        f"Generated from the argument parsers; do not edit by hand. Regenerate with `{COMMAND}`",
        "(from the repository root, in the environment where megatron-zb is installed).",
        "`tests/docs/test_flags_doc.py` fails when this page is out of date.",
        "",
        "## Zero-bubble flags (`megatron_zb.add_args`)",
        "",
        "`megatron_zb.add_args(parser)` adds these to any Megatron-LM parser (pass it as",
        "`extra_args_provider`); `megatron-zb train` has them too. Which schedule they select and",
        "what they refuse: [megatron.md](megatron.md), [user-guide.md](user-guide.md#troubleshooting).",
        "Memory limits count one microbatch's activations of a full pipeline stage.",
    ]
    for title in our_groups:
        heading = [f"### {title}", ""] if len(our_groups) > 1 else []
        lines += ["", *heading, *table(group_actions(ours, title))]
    lines += [
        "",
        "## Launcher-only flags (`megatron-zb train`)",
        "",
        "Megatron-LM does not have these; they apply to `megatron-zb train` and",
        "`python -m megatron_zb.pretrain_gpt` only (not with `--megatron-lm`).",
        "",
        *table(group_actions(launcher, LAUNCHER_GROUP)),
        "",
        "## Megatron-LM flags that `megatron-zb train` accepts",
        "",
        "Same names and defaults as Megatron-LM's pretrain_gpt. Any other Megatron-LM flag fails with",
        '"unrecognized arguments" (use `--megatron-lm` to run Megatron-LM\'s own loop with all of them).',
    ]
    for title in megatron_groups:
        lines += ["", f"### {title}", "", *table(group_actions(launcher, title))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that docs/flags.md is up to date")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="default: docs/flags.md")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
