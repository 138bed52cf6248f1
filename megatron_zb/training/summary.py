"""Compare training runs from their ``--metrics-file`` JSON lines: loss, time and measured bubble.

``python -m megatron_zb.training.summary base.jsonl other.jsonl ...``: the first file is the
baseline (e.g. the 1F1B run); each other run is shown with its largest per-iteration loss
difference from it and its iteration time relative to it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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
    return "\n".join(lines)


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
