"""Write docs/flags.md, the flags reference, from the flag table (``megatron_zb/flags/``; no torch needed).

    python scripts/gen_flags_doc.py            # rewrite docs/flags.md
    python scripts/gen_flags_doc.py --check    # exit 1 if docs/flags.md is out of date

Three tables: the zero-bubble group that ``megatron_zb.add_args`` adds to any Megatron-LM
parser, the flags only ``megatron-zb train`` has, and the Megatron-LM flags that
``megatron-zb train`` accepts. The parsers are built from the same rows, so the page says what
they parse. tests/docs/test_flags_doc.py fails when docs/flags.md differs from what this script writes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from megatron_zb.checks import flag
from megatron_zb.flags.launcher import LAUNCHER_FLAGS, LAUNCHER_GROUP
from megatron_zb.flags.table import Flag
from megatron_zb.flags.zero_bubble import ZERO_BUBBLE_FLAGS
from megatron_zb.megatron.args import help_fill

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "flags.md"
COMMAND = "python scripts/gen_flags_doc.py"


def groups(rows: Iterable[Flag]) -> dict[str, list[Flag]]:
    """The rows by argument group, in the order the parser lists them."""
    found: dict[str, list[Flag]] = {}
    for row in rows:
        found.setdefault(row.group, []).append(row)
    return found


def _value(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _argument(row: Flag) -> str:
    """What follows the flag on the command line: its metavar, else its type; empty for a switch."""
    if row.switch:
        return ""
    if row.metavar:
        text = row.metavar
    elif row.type in (int, float, str, None):
        text = (row.type or str).__name__
    else:
        text = "VALUE"
    return f"{text} ..." if row.nargs in ("*", "+") else text


def _range(row: Flag) -> str:
    if row.range is None:
        return ""
    return row.range.counted() if row.type is int else str(row.range)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(row: Flag, fill: Mapping[str, str]) -> str:
    """The help, then what a CPU run sets the flag to and where it departs from Megatron-LM's."""
    parts = [row.help_text(fill)] if row.help else []
    if row.on_cpu is not None:
        parts.append(f"On CPU: `{row.on_cpu.value or row.option}` ({row.on_cpu.why})")
    if row.excludes:
        parts.append("Not with " + "; ".join(f"{flag(name)}: {why}" for name, why in row.excludes))
    if row.differs is not None:
        parts.append(f"Unlike Megatron-LM's: {row.differs}")
    return _cell(". ".join(parts))


def table(rows: Iterable[Flag], fill: Mapping[str, str] | None = None) -> list[str]:
    """One Markdown row per flag: flag, argument, default, range, choices, help."""
    lines = ["| flag | argument | default | range | choices | help |", "|---|---|---|---|---|---|"]
    for row in rows:
        flags = ", ".join(f"`{option}`" for option in row.options)
        # a switch is off unless given, whatever it stores (--disable-bias-linear stores False)
        default = "required" if row.required else "off" if row.switch else _value(row.default)
        choices = ", ".join(f"`{choice}`" for choice in row.choices) if row.choices else ""
        argument = f"`{_argument(row)}`" if _argument(row) else ""
        lines.append(f"| {flags} | {argument} | {default} | {_range(row)} | {choices} | {_help(row, fill or {})} |")
    return lines


def render() -> str:
    """The whole of docs/flags.md."""
    fill = help_fill()
    launcher = groups(LAUNCHER_FLAGS)
    lines = [
        "# Flags reference",
        "",
        "Generated from the flag table (`megatron_zb/flags/`), which the parsers are built from; do not edit by",
        f"hand. Regenerate with `{COMMAND}` (from the repository root, in the environment where",
        "megatron-zb is installed). `tests/docs/test_flags_doc.py` fails when this page is out of date.",
        "A range is checked before anything starts, and the refusal names the flag.",
        "",
        "## Zero-bubble flags (`megatron_zb.add_args`)",
        "",
        "`megatron_zb.add_args(parser)` adds these to any Megatron-LM parser (pass it as",
        "`extra_args_provider`); `megatron-zb train` has them too. Which schedule they select and",
        "what they refuse: [megatron.md](megatron.md), [user-guide.md](user-guide.md#troubleshooting).",
        "Memory limits count one microbatch's activations of a full pipeline stage.",
    ]
    ours = groups(ZERO_BUBBLE_FLAGS)
    for title, rows in ours.items():
        heading = [f"### {title}", ""] if len(ours) > 1 else []
        lines += ["", *heading, *table(rows, fill)]
    lines += [
        "",
        "## Launcher-only flags (`megatron-zb train`)",
        "",
        "Megatron-LM does not have these; they apply to `megatron-zb train` and",
        "`python -m megatron_zb.pretrain_gpt` only (not with `--megatron-lm`).",
        "",
        *table(launcher.pop(LAUNCHER_GROUP)),
        "",
        "## Megatron-LM flags that `megatron-zb train` accepts",
        "",
        "Same names and defaults as Megatron-LM's pretrain_gpt. Any other Megatron-LM flag fails with",
        '"unrecognized arguments" (use `--megatron-lm` to run Megatron-LM\'s own loop with all of them).',
    ]
    for title, rows in launcher.items():
        lines += ["", f"### {title}", "", *table(rows)]
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
