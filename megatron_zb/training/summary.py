"""Compare training runs from their ``--metrics-file`` JSON lines: loss, time and measured bubble.

``python -m megatron_zb.training.summary base.jsonl other.jsonl ...``: the first file is the
baseline (e.g. the 1F1B run); each other run is shown with its largest per-iteration loss
difference from it and its iteration time relative to it. An iteration a file holds twice
(a run resumed from an older checkpoint logs it again) counts once, with its last line.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path


def read_rows(path: str | Path) -> list[dict]:
    """One row per iteration, in iteration order: where a resumed run logged an iteration again, its last row."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted({row["iteration"]: row for row in rows}.values(), key=lambda row: row["iteration"])


def summarize(paths: Sequence[str | Path]) -> str:
    runs = [read_rows(path) for path in paths]
    base = {row["iteration"]: row["loss"] for row in runs[0]}
    base_time = _median_time(runs[0])
    lines = [
        f"{'schedule':18s} {'iters':>5s} {'first loss':>11s} {'last loss':>10s} {'max rel diff':>12s} "
        f"{'bubble':>7s} {'time/iter':>10s} {'vs base':>8s}"
    ]
    for rows in runs:
        bubbles = [row["bubble_rate"] for row in rows if row.get("bubble_rate") is not None]
        common = [row for row in rows if row["iteration"] in base]
        diff = max(
            (abs(row["loss"] - base[row["iteration"]]) / abs(base[row["iteration"]]) for row in common), default=0
        )
        time = _median_time(rows)
        lines.append(
            f"{rows[0]['schedule']:18s} {len(rows):5d} {rows[0]['loss']:11.4f} {rows[-1]['loss']:10.4f} "
            f"{diff:12.1e} {(f'{100 * statistics.mean(bubbles):6.1f}%' if bubbles else '      -'):>7s} "
            f"{1000 * time:8.1f}ms {time / base_time:8.3f}"
        )
    lines.append(
        "bubble: measured idle share of each pipeline rank's forward-backward time (mean over ranks and iterations); "
        "time/iter: median over the iterations after the first"
    )
    lines += _idle_lines(runs)
    return "\n".join(lines)


_IDLE_PARTS = ("span", "compute", "planned_wait", "unplanned_wait", "send_recv", "python")


def _idle_lines(runs: list[list[dict]]) -> list[str]:
    """The logging rank's idle breakdown per run (``training.idle``), measured (predicted), ms per iteration."""
    rows_with = [(rows[0]["schedule"], [row["idle"] for row in rows[1:] if row.get("idle")]) for rows in runs]
    rows_with = [(name, found) for name, found in rows_with if found]
    if not rows_with:
        return []
    lines = ["", f"{'schedule':18s} " + " ".join(f"{part:>17s}" for part in _IDLE_PARTS)]
    for name, found in rows_with:
        cells = []
        for part in _IDLE_PARTS:
            measured = statistics.fmean(item["measured"][part] for item in found)
            planned = statistics.fmean(item["predicted"][part] for item in found)
            cells.append(f"{1000 * measured:8.1f} ({1000 * planned:6.1f})")
        lines.append(f"{name:18s} " + " ".join(cells))
    lines.append(
        "idle breakdown of the logging rank's executor run, ms per iteration after the first: measured (the plan "
        "scaled to the measured compute); idle = planned wait + unplanned wait + send/recv + python"
    )
    return lines


def _median_time(rows: list[dict]) -> float:
    times = [row["iteration_time_s"] for row in rows[1:]] or [rows[0]["iteration_time_s"]]
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m megatron_zb.training.summary BASE.jsonl [OTHER.jsonl ...]", file=sys.stderr)
        return 2
    print(summarize(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
