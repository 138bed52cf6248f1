"""docs/flags.md is what scripts/gen_flags_doc.py writes from the flag table, and it names every flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_zb.flags.launcher import LAUNCHER_FLAGS
from megatron_zb.flags.table import COUNT, Flag
from megatron_zb.megatron.args import add_args
from megatron_zb.testing.scripts import load_script
from megatron_zb.training.arguments import build_parser

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python scripts/gen_flags_doc.py"


gen = load_script("gen_flags_doc")


def test_flags_doc_is_up_to_date():
    current = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert current == gen.render(), f"docs/flags.md is out of date; regenerate it with `{REGENERATE}`"


def test_every_option_of_the_parsers_is_documented():
    """The page is written from the rows, the parsers are built from them: every option they parse is on it."""
    import argparse

    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    for parser in (add_args(argparse.ArgumentParser(add_help=False)), build_parser()):
        options = [option for action in parser._actions for option in action.option_strings if option != "-h"]
        assert "--enable-zero-bubble" in options and "--pipeline-schedule" in options
        missing = [option for option in options if option != "--help" and f"`{option}`" not in text]
        assert not missing, f"not in docs/flags.md: {missing}; regenerate it with `{REGENERATE}`"


def test_the_launcher_only_section_lists_the_launchers_own_group():
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    section = text.split("## Launcher-only flags")[1].split("## Megatron-LM flags")[0]
    own = [row.option for row in LAUNCHER_FLAGS if row.group == "launcher (megatron-zb)"]
    assert "--cpu" in own and "--metrics-file" in own
    assert all(f"`{option}`" in section for option in own)


def test_table_rows_show_default_range_choices_and_help():
    rows = gen.table(
        [
            Flag("--mode", "pick | one", choices=("a", "b"), default="a"),
            Flag("--limit", type=float, default=600.0, metavar="SECONDS"),
            Flag("--on", switch=True),
            Flag("--count", type=int, required=True, range=COUNT),
        ]
    )
    assert rows[2] == "| `--mode` | `str` | a |  | `a`, `b` | pick \\| one |"
    assert rows[3] == "| `--limit` | `SECONDS` | 600 |  |  |  |"
    assert rows[4] == "| `--on` |  | off |  |  |  |"
    assert rows[5] == "| `--count` | `int` | required | at least 1 |  |  |"


def test_check_mode_reports_drift(tmp_path, capsys):
    stale = tmp_path / "flags.md"
    stale.write_text("old\n", encoding="utf-8")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--check", "--output", str(stale)]) == 0


def test_generator_does_not_import_torch():
    code = (
        "import runpy, sys; gen = runpy.run_path('scripts/gen_flags_doc.py'); gen['render'](); "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, "gen_flags_doc imports torch"
