"""The stall campaign: random stalls, by SIGSTOP and by sleep, each named by the launcher within the timeout + 10 s.

Every run draws a stall (``megatron_zb.testing.stall.draw_stall``: the rank, pp 2 or 4, megatron-zb's
schedules or megatron-core's own 1F1B, the iteration, a model forward, the grad-norm all-reduce or the
checkpoint save), trains with ``--distributed-timeout-minutes`` (default 1) and no other timeout flag, and
checks that the launcher's report names that rank first, within the timeout + 10 s of the stall (measured to
the moment its report line is read; the launcher's exit, after it ends the ranks, is shown too).
``--megatron-lm`` adds runs through Megatron-LM's own ``pretrain()`` (megatron-core >= 0.17, or a checkout
on the path). Several runs go at once (``--jobs``): a
stalled run's ranks wait, idle.

    python scripts/stall_campaign.py --count 20 --jobs 4 --output docs/stall_campaign.md
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zb.testing.stall import HOW, draw_stall  # noqa: E402

NAMED = re.compile(r"megatron-zb train: timeout: ranks? (\d+)[ ,]")


@dataclass
class Outcome:
    fault: dict
    flags: list[str]
    named: int | None
    seconds: float | None  # from the stall to the launcher's report line
    exit_seconds: float | None  # from the stall to the launcher's exit
    traceback: bool
    code: int

    @property
    def passed(self) -> bool:
        return (
            self.named == self.fault["rank"]
            and self.seconds is not None
            and self.seconds <= self.fault["timeout_s"] + 10
            and not self.traceback
            and self.code == 1
        )


def run(fault: dict, flags: list[str]) -> Outcome:
    command = [sys.executable, "-m", "megatron_zb.testing.stall", json.dumps(fault), *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, named, reported = [], None, None
    for line in process.stderr:  # read as it comes: the report's time is when its line arrives
        lines.append(line)
        match = NAMED.search(line) if named is None else None
        if match:
            named, reported = int(match.group(1)), time.time()
    process.wait(timeout=fault["timeout_s"] + 600)
    ended, stderr, mark = time.time(), "".join(lines), Path(fault["mark"])
    stalled = float(mark.read_text()) if mark.exists() else None
    return Outcome(fault, flags, named, None if stalled is None or reported is None else reported - stalled,
                   None if stalled is None else ended - stalled, "Traceback" in stderr, process.returncode)  # fmt: skip


def campaign(count: int, timeout_s: float, seed: int, megatron_lm: int, folder: Path) -> list[tuple[dict, list]]:
    rng = random.Random(seed)
    runs = []
    for how in HOW:
        for index in range(count):
            mark = str(folder / f"{how}-{index}")
            fault, flags = draw_stall(rng.choice, mark, timeout_s)
            fault["how"] = how
            runs.append((fault, flags))
    for index in range(megatron_lm):
        mark = str(folder / f"megatron-lm-{index}")
        fault, flags = draw_stall(rng.choice, mark, timeout_s)
        if fault["at"] == "save":  # Megatron-LM's own save is not megatron-zb's: stall in a forward there
            fault.update(at="forward", call=1)
            flags = flags[: flags.index("--save")]
        runs.append((fault, ["--megatron-lm", *_megatron_lm_flags(flags)]))
    return runs


def _megatron_lm_flags(flags: list[str]) -> list[str]:
    """The launcher's stall model as Megatron-LM's pretrain_gpt flags (its NullTokenizer, evaluation off)."""
    out = [flag for flag in flags if flag != "--cpu"]
    return ["--cpu", *out, "--tokenizer-type", "NullTokenizer", "--max-position-embeddings", "16", "--eval-iters", "0",
            "--eval-interval", "10"]  # fmt: skip


def describe(outcome: Outcome) -> list[str]:
    fault, flags = outcome.fault, outcome.flags
    pp = flags[flags.index("--pipeline-model-parallel-size") + 1]
    schedule = flags[flags.index("--pipeline-schedule") + 1] if "--pipeline-schedule" in flags else "megatron-core"
    route = "pretrain()" if "--megatron-lm" in flags else "launcher"
    point = fault["at"] + (f" #{fault['call']}" if fault["at"] == "forward" else "")
    seconds = "-" if outcome.seconds is None else f"{outcome.seconds:.1f}"
    exit_seconds = "-" if outcome.exit_seconds is None else f"{outcome.exit_seconds:.1f}"
    return [route, schedule, pp, str(fault["rank"]), str(fault["iteration"]), point, fault["how"],
            str(outcome.named), seconds, exit_seconds, "yes" if outcome.passed else "**no**"]  # fmt: skip


def table(outcomes: list[Outcome], timeout_s: float, elapsed: float, command: str) -> str:
    header = ["route", "schedule", "pp", "rank", "iteration", "point", "how", "named", "s to report", "s to exit", "ok"]
    rows = [header, ["---"] * len(header), *(describe(o) for o in outcomes)]
    passed = {how: sum(o.passed for o in outcomes if o.fault["how"] == how) for how in HOW}
    runs = {how: sum(o.fault["how"] == how for o in outcomes) for how in HOW}
    lines = [
        "# Stall campaign",
        "",
        f"`{command}`: {len(outcomes)} random stalls with `--distributed-timeout-minutes {timeout_s / 60:g}` and no "
        f"other timeout flag, {elapsed / 60:.0f} min. A run passes when the launcher names the stalled rank first, "
        f"within the timeout + 10 s of the stall (measured to the moment its report line is read; the launcher then "
        "ends the ranks and exits, shown too), with no traceback.",
        "",
        *(f"- {how}: {passed[how]} of {runs[how]} named" for how in HOW),
        "",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20, help="stalls per way of stalling (SIGSTOP, sleep)")
    parser.add_argument("--timeout-minutes", type=float, default=1.0)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--megatron-lm", type=int, default=0, metavar="N", help="also N runs through pretrain()")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="stall-campaign-") as folder:
        runs = campaign(args.count, 60 * args.timeout_minutes, args.seed, args.megatron_lm, Path(folder))
        with ThreadPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(lambda pair: run(*pair), runs))
    command = "python scripts/stall_campaign.py " + " ".join(sys.argv[1:])
    text = table(outcomes, 60 * args.timeout_minutes, time.time() - start, command)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
