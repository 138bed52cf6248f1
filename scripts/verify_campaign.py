"""Every GPT line of Megatron-LM's functional tests through ``megatron-zb verify --megatron-lm``: a table of outcomes.

Each line is a ``model_config.yaml`` of Megatron-LM's functional tests (``../shared/megatron-lm/functional-configs``):
its MODEL_ARGS become the pretrain_gpt argv (``flag: value``; ``true`` a bare flag, ``false`` left out; ``${VAR}``
a path in a scratch folder, so data files are missing and verify falls back to mock data), its ENV_VARS the
environment, and one zero-bubble flag is added. An outcome is one of:

- ``OK``: both runs trained and agree;
- ``refused``: refused before any process started (exit 2; the reason is quoted);
- ``mismatch``: both trained and differ (exit 1, MISMATCH);
- ``failed``: a run failed after its processes started (exit 1);
- ``timed out``;
- ``not pretraining``: the config's MODE is inference or rl (another script than pretrain_gpt.py): not run.

Resumable: every outcome is appended to ``--results`` (JSON lines) as it comes, and a second call runs only the
lines not there yet. ``--table`` writes the Markdown table. ``--sample N`` runs a drawn sample (``--seed``).
It runs for an hour or more on two cores (30-90 s a line). Example::

    python scripts/verify_campaign.py --megatron-lm ../shared/megatron-lm/core_v0.19.0 \\
        --results docs/verify_campaign.jsonl --table docs/verify_campaign.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT.parent / "shared" / "megatron-lm" / "functional-configs" / "core_v0.19.0" / "gpt"
TWINS = ("_1node", "_gb200")  # the same line on other cluster sizes
OUTCOMES = ("OK", "refused", "mismatch", "failed", "timed out", "not pretraining")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
NUMBERS = ("REPEAT",)  # placeholders the runner fills with a number, not a path


@dataclass(frozen=True)
class Line:
    name: str
    argv: list[str]
    environment: dict[str, str]
    mode: str = "pretraining"  # the config's MODE: inference and rl lines run other scripts than pretrain_gpt.py
    mode_given: bool = True  # False: the config gives no MODE (nor MODEL_ARGS); its name says inference


def lines(configs: Path) -> list[Line]:
    """The lines of every ``<name>/model_config.yaml`` under ``configs``, the cluster-size twins left out."""
    import yaml

    found = []
    scratch = Path(tempfile.gettempdir()) / "megatron-zb-campaign"
    for config in sorted(configs.glob("*/model_config.yaml")):
        name = config.parent.name
        if any(twin in name for twin in TWINS):
            continue
        data = yaml.safe_load(config.read_text()) or {}
        argv = []
        for flag, value in (data.get("MODEL_ARGS") or {}).items():
            if value is False or value is None:
                continue
            argv.append(flag)
            if value is True:
                continue
            values = value if isinstance(value, list) else _words(value)
            argv += [PLACEHOLDER.sub(lambda match: _filled(match.group(1), scratch), str(item)) for item in values]
        environment = {key: str(value) for key, value in (data.get("ENV_VARS") or {}).items()}
        found.append(Line(name, argv, environment, *_mode(name, data)))
    return found


def _mode(name: str, data: dict) -> tuple[str, bool]:
    """(the line's mode, whether its config says it): MODE, else inference for a config that gives no MODEL_ARGS
    and is named as one (``gpt_dynamic_inference_...``), else pretraining."""
    if data.get("MODE"):
        return str(data["MODE"]), True
    if not data.get("MODEL_ARGS") and "inference" in name.split("_"):
        return "inference", False
    return "pretraining", True


def _words(value: object) -> list[object]:
    """A value as the runner passes it: one word, or several numbers ("2 2", "[2 2]") or words ("[attn mlp]") for a
    flag that takes a list."""
    text = str(value).strip()
    numbers = text.strip("[]").replace(",", " ").split()
    if " " in text and all(re.fullmatch(r"-?[\d.]+(e-?\d+)?", number) for number in numbers):
        return numbers
    if (
        " " in text
        and text.startswith("[")
        and text.endswith("]")
        and all(re.fullmatch(r"[\w.-]+", w) for w in numbers)
    ):
        return numbers
    if re.fullmatch(r"\[[A-Za-z_][\w.-]*\]", text):  # one word of a list ("[moe_act]"); "[1,0]" is one value
        return [text[1:-1]]
    return [value]


def _filled(name: str, scratch: Path) -> str:
    """What the test runner puts for ``${name}``: the repeat number, else a path (here in a scratch folder)."""
    return "1" if name in NUMBERS else str(scratch / name)


def run(line: Line, checkout: str | None, flag: list[str], timeout_s: float) -> dict:
    """One verify of ``line`` with ``flag`` added: its outcome, the sentence that says why, and its time."""
    if line.mode != "pretraining":
        why = f"MODE: {line.mode}: Megatron-LM runs this line with its {line.mode} script, not pretrain_gpt.py"
        if not line.mode_given:
            why = (
                f"no MODE and no MODEL_ARGS: an {line.mode} test by its name (its flags are not in the config); "
                "nothing for pretrain_gpt.py to run"
            )
        return {"outcome": "not pretraining", "why": why, "seconds": 0.0}
    command = [sys.executable, "-m", "megatron_zb", "verify"]
    command += ["--megatron-lm", checkout] if checkout else []
    command += ["--", *line.argv, *flag]
    environment = {**os.environ, **line.environment}
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"outcome": "timed out", "why": f"no verdict after {timeout_s:.0f} s", "seconds": timeout_s}
    seconds = round(time.monotonic() - start, 1)
    outcome, why = classify(done.returncode, done.stdout, done.stderr)
    return {"outcome": outcome, "why": why, "seconds": seconds}


def classify(code: int, out: str, err: str) -> tuple[str, str]:
    """(outcome, the line that says why) of one verify."""
    said = [line for line in (out + "\n" + err).splitlines() if line.strip()]
    if code == 0 and any(line.startswith("OK: ") for line in said):
        return "OK", next(line for line in said if line.startswith("OK: "))
    if code == 2:
        errors = [line for line in said if "error:" in line]
        return "refused", (errors or said or ["(nothing said)"])[-1].split("error: ", 1)[-1]
    mismatch = [line for line in said if line.startswith("MISMATCH")]
    if mismatch:
        return "mismatch", mismatch[-1]
    failed = [line.split("verify: ", 1)[-1] for line in said if "failed" in line and "run with" in line]
    last = [line for line in err.splitlines() if line.strip()]
    return "failed", " / ".join([*failed[-1:], *last[-1:]]) or f"exit status {code}"


def table(results: dict[str, dict]) -> str:
    counts = {outcome: sum(row["outcome"] == outcome for row in results.values()) for outcome in OUTCOMES}
    head = ", ".join(f"{count} {outcome}" for outcome, count in counts.items() if count)
    checkouts = sorted({row.get("checkout", "?") for row in results.values()})
    suites = sorted({row["configs"] for row in results.values() if row.get("configs")})
    where = f" Configs: {', '.join(suites)}." if suites else ""
    rows = [
        "# Megatron-LM's functional-test lines through `megatron-zb verify`",
        "",
        "Written by `scripts/verify_campaign.py` (see its docstring; docs/compatibility.md says how it was run). "
        f"Megatron-LM: {', '.join(checkouts)}.{where} {len(results)} lines: {head}.",
        "",
        "| line | flag | outcome | why | s |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(results):
        row = results[name]
        why = row["why"].replace("|", "\\|")
        why = why if len(why) <= 300 else why[:297] + "..."
        rows.append(f"| {name} | `{row['flag']}` | {row['outcome']} | {why} | {row['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


def checkout_name(path: str | None) -> str:
    """The checkout a row ran on, by its folder's name (core_v0.19.0), or the installed megatron.training."""
    return os.path.basename(os.path.normpath(path)) if path else "installed megatron.training"


def read_results(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    return {row["line"]: row for row in map(json.loads, path.read_text().splitlines()) if row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--configs", type=Path, nargs="+", default=[CONFIGS], help="folder(s) of <line>/model_config.yaml"
    )
    parser.add_argument("--megatron-lm", default=None, metavar="PATH", help="the checkout verify runs (its own flag)")
    parser.add_argument("--flag", default="--enable-zero-bubble", help="the zero-bubble flag(s) added to every line")
    parser.add_argument("--results", type=Path, required=True, help="JSON lines, appended to and resumed from")
    parser.add_argument("--table", type=Path, default=None, help="write the Markdown table here")
    parser.add_argument("--sample", type=int, default=None, help="run only this many lines, drawn with --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, metavar="LINE", help="run only these lines")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per verify (default 900)")
    options = parser.parse_args(argv)
    every = [line for folder in options.configs for line in lines(folder)]
    suite = {line.name: folder.name for folder in options.configs for line in lines(folder)}
    if not every:
        parser.error(f"no model_config.yaml under {options.configs}")
    chosen = [line for line in every if options.only is None or line.name in options.only]
    if options.sample is not None:
        chosen = random.Random(options.seed).sample(chosen, min(options.sample, len(chosen)))
    results = read_results(options.results)
    for number, line in enumerate(chosen, 1):
        if line.name in results:
            continue
        found = {
            "line": line.name,
            "flag": options.flag,
            "checkout": checkout_name(options.megatron_lm),
            "configs": suite[line.name],
            **run(line, options.megatron_lm, options.flag.split(), options.timeout),
        }
        results[line.name] = found
        with options.results.open("a") as file:
            file.write(json.dumps(found) + "\n")
        print(
            f"[{number}/{len(chosen)}] {line.name}: {found['outcome']} ({found['seconds']:.0f} s) {found['why']}",
            flush=True,
        )
    if options.table is not None:
        options.table.write_text(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
