"""docs/flags.md is what scripts/gen_flags_doc.py writes from the parsers, and it names every flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from megatron_zb.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python scripts/gen_flags_doc.py"


gen = load_script("gen_flags_doc")


def test_flags_doc_is_up_to_date():
    current = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert current == gen.render(), f"docs/flags.md is out of date; regenerate it with `{REGENERATE}`"


def test_every_add_args_option_is_documented():
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    options = [option for action in gen.add_args_parser()._actions for option in action.option_strings]
    assert "--enable-zero-bubble" in options and "--pipeline-schedule" in options
    missing = [option for option in options if f"`{option}`" not in text]
    assert not missing, f"not in docs/flags.md: {missing}; regenerate it with `{REGENERATE}`"


def test_every_launcher_only_option_is_documented():
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    launcher = gen.group_actions(gen.build_parser(), gen.LAUNCHER_GROUP)
    options = [option for action in launcher for option in action.option_strings]
    assert "--cpu" in options and "--metrics-file" in options
    assert all(f"`{option}`" in text for option in options)


def test_table_rows_show_default_choices_and_help():
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--mode", choices=("a", "b"), default="a", help="pick | one")
    parser.add_argument("--limit", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--on", action="store_true")
    rows = gen.table(parser._actions)
    assert rows[2] == "| `--mode` | `str` | a | `a`, `b` | pick \\| one |"
    assert rows[3] == "| `--limit` | `SECONDS` | 600 |  |  |"
    assert rows[4] == "| `--on` |  | off |  |  |"


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
