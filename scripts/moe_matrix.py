"""The MoE acceptance matrix through Megatron-LM's pretrain() or the launcher's own loop: every schedule against 1F1B.

Two tiny MoE lines (the launcher's in tests/training/test_moe_training.py, on the pretrain() test's GPT of
tests/megatron/test_real_megatron_lm.py):

- mixtral: 8 experts, top-2, the alltoall dispatcher, aux loss and z-loss, token dropping (capacity 1.5), fp32 router;
- deepseek: fine-grained experts (8 of FFN size 16, top-3), a gated shared expert, the first layer dense
  (``--moe-layer-freq``), the allgather dispatcher, the per-sequence aux loss, sigmoid routing with expert bias.

Each row is one ``python -m megatron_zb.pretrain_gpt --megatron-lm <copy of the checkout> --cpu`` launch of 10
iterations at pp 2 with expert parallelism 1 (2 processes) or 2 (pp 2 x dp 2: 4 processes). Every row, the
reference too, draws its weights with ``--zero-bubble-placement-independent-init``, so V and BitPipe placements
start from 1F1B's weights. A row's result is ``OK`` (loss and grad norm of every iteration within 1e-5 relative of
the reference), ``differs`` (the largest relative difference), ``refused`` (exit 2 before spawn: the message) or
``failed`` (the last line of its error). The ``resume`` row saves zb-v at iteration 5, resumes, and compares 6-10
with the uninterrupted zb-v run; ``bitpipe-zb resume`` does the same with BitPipe (two copies of each block, one saved).

``--launcher`` runs the same rows through the launcher's own training loop instead (no ``--megatron-lm``: the
megatron-core installed in this Python), into ``docs/moe_matrix_launcher.md`` (``.jsonl``); its rows are keyed
``launcher-mcore-<version>``. ``--lock PATH`` holds that file's lock (as ``flock PATH``) during each launch, so
that rows take turns with other gloo runs on a shared machine; a row's seconds exclude the wait.

Resumable: rows are appended to ``--results`` (JSON lines) as they finish, and rows already there are skipped
(``--retry-failed`` runs the failed ones again, ``--only SCHEDULE`` the rows of that schedule, its references taken
from ``--results``); each run's command and output are kept in
``$TMPDIR/moe-matrix-logs``. One row at a time (10-40 s of gloo processes each; a checkout in 10-20 min). Example::

    .venv/bin/python scripts/moe_matrix.py --megatron-lm ../shared/megatron-lm/core_v0.16.1
    .venv/bin/python scripts/moe_matrix.py --launcher --lock /tmp/gloo.lock
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_zb.testing import checkouts  # noqa: E402

ITERATIONS, HALF = 10, 5
TOLERANCE = 1e-5  # relative, as the pretrain() tests
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --pipeline-model-parallel-size 2 --hidden-dropout 0 "
    "--attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 10 --seed 1234 --clip-grad 0.05 "
    "--disable-bias-linear --zero-bubble-placement-independent-init"
)
MODELS = {
    "mixtral": (
        "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-token-dispatcher-type alltoall "
        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
        "--moe-expert-capacity-factor 1.5 --moe-router-dtype fp32 --moe-grouped-gemm"
    ),
    "deepseek": (
        "--num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 32 "
        "--moe-shared-expert-gate --moe-layer-freq [0]+[1]*3 --moe-token-dispatcher-type allgather "
        "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-score-function sigmoid "
        "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2"
    ),
}
REFERENCE = "1f1b"
SCHEDULES = {
    REFERENCE: "",  # megatron-core's own schedule
    "zb-1p": "--pipeline-schedule zb-1p",
    "zb-2p": "--pipeline-schedule zb-2p",
    "zb-v": "--pipeline-schedule zb-v",
    "interleaved zb": "--pipeline-schedule zb-1p --num-layers-per-virtual-pipeline-stage 1",
    "bitpipe-zb": "--pipeline-schedule bitpipe-zb",
    "v-auto": "--pipeline-schedule v-auto",
}
# the resume rows (row name -> schedule): saved at HALF, resumed, HALF+1..ITERATIONS against the uninterrupted run
RESUMED = {"resume": "zb-v", "bitpipe-zb resume": "bitpipe-zb"}
EXPERT_PARALLEL = (1, 2)
LOGS = Path(tempfile.gettempdir()) / "moe-matrix-logs"  # each run's command and output, kept for a failed row


def row_key(row: dict) -> tuple[str, str, int, str]:
    return row["checkout"], row["model"], row["ep"], row["schedule"]


class Launch:
    """How each row starts: through pretrain() of the checkout copy at ``root``, or the launcher's own loop (None);
    under ``flock lock`` when given."""

    def __init__(self, root: Path | None, name: str, lock: Path | None) -> None:
        self.root, self.name, self.lock = root, name, lock

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "megatron_zb.pretrain_gpt"]
        return command + (["--megatron-lm", str(self.root)] if self.root is not None else []) + ["--cpu"]

    @contextlib.contextmanager
    def turn(self):
        """Hold ``lock`` (flock's lock, exclusive) for one launch; a row's seconds start once it is held."""
        if self.lock is None:
            yield
            return
        with self.lock.open("a") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(file, fcntl.LOCK_UN)


def launch(how: Launch, model: str, ep: int, flags: str, metrics: Path, *extra: str) -> tuple:
    """One run of ``model`` at expert parallelism ``ep`` with ``flags``: (the process, its seconds,
    iteration -> (loss, grad norm))."""
    processes = 2 * ep  # pp 2 x dp ep
    command = how.command()
    command += ["--cpu-procs", str(processes), *MODEL.split(), *MODELS[model].split()]
    command += ["--expert-model-parallel-size", str(ep), *flags.split(), "--metrics-file", str(metrics)]
    command += ["--train-iters", str(ITERATIONS), *extra]
    with how.turn():
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT)
        seconds = round(time.monotonic() - start, 1)
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / f"{how.name}-{metrics.stem}.log").write_text(" ".join(command) + "\n" + done.stdout + done.stderr)
    return done, seconds, metrics_rows(metrics)


def metrics_rows(metrics: Path) -> dict[int, tuple[float, float]]:
    if not metrics.exists():
        return {}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {row["iteration"]: (row["loss"], row["grad_norm"]) for row in rows}


def largest_difference(found: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]]) -> float:
    """The largest relative difference of loss or grad norm over the reference's iterations (inf: one missing)."""
    worst = 0.0
    for iteration, theirs in reference.items():
        if iteration not in found:
            return float("inf")
        for ours, their in zip(found[iteration], theirs, strict=True):
            worst = max(worst, abs(ours - their) / max(abs(their), 1e-30))
    return worst


def failure(done: subprocess.CompletedProcess) -> tuple[str, str]:
    """(result, why) of a run that did not finish: refused (exit 2, before spawn) or failed."""
    said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2:
        errors = [line for line in said if "error:" in line]
        return "refused", (errors or said or ["(nothing said)"])[-1].split("error: ", 1)[-1]
    causes = [line for line in said if "Error" in line or "error" in line]
    return "failed", (causes or said or [f"exit status {done.returncode}"])[-1][:400]


def compared(done, seconds, found, reference, base: dict) -> dict:
    if done.returncode != 0:
        result, why = failure(done)
        return {**base, "result": result, "why": why, "seconds": seconds}
    if not reference:
        return {**base, "result": "failed", "why": "the reference did not train", "seconds": seconds}
    worst = largest_difference(found, reference)
    result = "OK" if worst <= TOLERANCE else "differs"
    measured = {str(it): list(value) for it, value in sorted(found.items())}
    return {**base, "result": result, "max_rel_diff": worst, "why": "", "seconds": seconds, "iterations": measured}


def run_matrix(
    how: Launch, scratch: Path, results: Path, done_rows: dict, only: list[str], sizes: tuple[int, ...]
) -> None:
    """Every (model, EP, schedule) row not in ``done_rows`` (of the ``only`` schedules when given), then the resume
    row, at the expert-parallel ``sizes``; the reference's iterations come from its recorded row."""
    name = how.name
    for model in MODELS:
        for ep in sizes:
            for schedule, flags in SCHEDULES.items():
                if only and schedule not in only:
                    continue
                base = {"checkout": name, "model": model, "ep": ep, "schedule": schedule}
                resume = next((row for row, resumed in RESUMED.items() if resumed == schedule), None)
                saving = resume is not None and row_key({**base, "schedule": resume}) not in done_rows
                if row_key(base) in done_rows and not saving:
                    continue
                reference = iterations(done_rows.get(row_key({**base, "schedule": REFERENCE})))
                label = f"{model}-ep{ep}-{schedule.replace(' ', '-')}"
                checkpoint = scratch / f"{label}-ckpt"
                extra = ("--save", str(checkpoint), "--save-interval", str(HALF)) if saving else ()
                done, seconds, found = launch(how, model, ep, flags, scratch / f"{label}.jsonl", *extra)
                row = compared(done, seconds, found, found if schedule == REFERENCE else reference, base)
                falls = ITERATIONS in found and 1 in found and found[ITERATIONS][0] < found[1][0]
                if schedule == REFERENCE and row["result"] == "OK" and not falls:
                    row = {**row, "result": "differs", "why": "the loss did not fall"}
                record(row, results, done_rows)  # a later line of the same row supersedes an earlier
                if saving and done.returncode == 0:
                    (checkpoint / "latest_checkpointed_iteration.txt").write_text(str(HALF))
                    resumed = {"checkout": name, "model": model, "ep": ep, "schedule": resume}
                    again, seconds, later = launch(
                        how, model, ep, flags, scratch / f"{label}-resumed.jsonl", "--load", str(checkpoint)
                    )
                    uninterrupted = {it: value for it, value in found.items() if it > HALF}
                    row = compared(again, seconds, later, uninterrupted, resumed)
                    if row["result"] == "OK" and sorted(later) != sorted(uninterrupted):
                        row = {**row, "result": "differs", "why": f"iterations {sorted(later)}"}
                    record(row, results, done_rows)


def iterations(row: dict | None) -> dict[int, tuple[float, float]]:
    """A recorded row's iteration -> (loss, grad norm) (empty: none recorded)."""
    return {int(it): tuple(value) for it, value in (row or {}).get("iterations", {}).items()}


def record(row: dict, results: Path, done_rows: dict) -> None:
    done_rows[row_key(row)] = row
    with results.open("a") as file:
        file.write(json.dumps(row) + "\n")
    shown = f"{row['result']}" + (f" ({row['max_rel_diff']:.1e})" if "max_rel_diff" in row else "")
    print(
        f"{row['checkout']} {row['model']} ep{row['ep']} {row['schedule']}: {shown} {row['seconds']:.0f} s",
        row["why"],
        flush=True,
    )


def read_results(path: Path) -> dict:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row_key(row): row for row in rows}


def result_text(row: dict) -> str:
    if row["schedule"] == REFERENCE and row["result"] == "OK":
        first, last = row["iterations"]["1"][0], row["iterations"][str(ITERATIONS)][0]
        return f"reference (loss {first:.4f} to {last:.4f})"
    if row["result"] == "OK" and "max_rel_diff" in row:
        return f"OK ({row['max_rel_diff']:.1e})"
    if row["result"] == "differs" and "max_rel_diff" in row:
        return f"differs ({row['max_rel_diff']:.1e})" + (f": {row['why']}" if row["why"] else "")
    if row["result"] in ("refused", "failed"):
        return f"{row['result']}: {row['why']}".replace("|", "\\|")
    return row["result"]


def table(rows: dict, launcher: bool = False) -> str:
    order = [REFERENCE, *[name for name in SCHEDULES if name != REFERENCE], *RESUMED]
    ranked = sorted(
        rows.values(),
        key=lambda r: (r["checkout"], list(MODELS).index(r["model"]), r["ep"], order.index(r["schedule"])),
    )
    counts: dict[str, int] = {}
    for row in ranked:
        counts[row["result"]] = counts.get(row["result"], 0) + 1
    head = ", ".join(f"{count} {result}" for result, count in sorted(counts.items()))
    if launcher:
        title, what = (
            "the launcher's own training loop",
            "`python -m megatron_zb.pretrain_gpt --cpu` (no --megatron-lm)",
        )
        how = (
            "Run as `.venv/bin/python scripts/moe_matrix.py --launcher --lock /tmp/gloo.lock` (Python 3.11, "
            "megatron-core 0.16.1 installed) and `.venv-mcore-0.19.2/bin/python scripts/moe_matrix.py --launcher "
            "--lock /tmp/gloo.lock` (Python 3.12, megatron-core 0.19.2 installed): the ranks import the installed "
            "megatron-core and train in megatron-zb's own loop (megatron_zb/training/). The pretrain() matrix of the "
            "same rows: [moe_matrix.md](moe_matrix.md)."
        )
        column = "megatron-core"
    else:
        title, what = "Megatron-LM's pretrain()", "`python -m megatron_zb.pretrain_gpt --megatron-lm <checkout> --cpu`"
        how = (
            "Run as `.venv/bin/python scripts/moe_matrix.py --megatron-lm ../shared/megatron-lm/core_v0.16.1` "
            "(Python 3.11, megatron-core 0.16.1 installed) and `.venv-mcore-0.19.2/bin/python scripts/moe_matrix.py "
            "--megatron-lm ../shared/megatron-lm/core_v0.19.0` (Python 3.12, megatron-core 0.19.2 installed); the "
            "checkout is copied to a temporary folder and its megatron-core is the one the ranks import."
        )
        column = "checkout"
    lines = [
        f"# MoE schedules through {title}: the acceptance matrix",
        "",
        "Written by `scripts/moe_matrix.py` (its docstring gives the two models and how a row is compared): each row "
        f"is {ITERATIONS} iterations of {what} at pp 2, "
        "expert parallelism 1 (2 gloo processes) or 2 (4), compared with megatron-core's 1F1B of the same line "
        f"(loss and grad norm, {TOLERANCE:g} relative; OK gives the largest relative difference). `resume` "
        f"(`bitpipe-zb resume`): zb-v (bitpipe-zb) saved at iteration {HALF} and resumed, against "
        f"the uninterrupted run. {len(ranked)} rows: {head}.",
        "",
        how,
        "",
        f"| {column} | model | EP | schedule | result | s |",
        "|---|---|---|---|---|---|",
    ]
    for row in ranked:
        lines.append(
            f"| {row['checkout']} | {row['model']} | {row['ep']} | {row['schedule']} | {result_text(row)} "
            f"| {row['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--megatron-lm", type=Path, default=checkouts.SHARED_CHECKOUT, metavar="PATH")
    parser.add_argument(
        "--launcher", action="store_true", help="through the launcher's own loop (the installed megatron-core)"
    )
    parser.add_argument("--lock", type=Path, metavar="PATH", help="run each launch under flock PATH")
    parser.add_argument("--results", type=Path, help="default: docs/moe_matrix.jsonl (_launcher.jsonl)")
    parser.add_argument("--table", type=Path, help="default: docs/moe_matrix.md (_launcher.md)")
    parser.add_argument("--table-only", action="store_true", help="write the table from --results and stop")
    parser.add_argument("--retry-failed", action="store_true", help="run the rows that failed again")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=[name for name in SCHEDULES if name != REFERENCE],
        metavar="SCHEDULE",
        help="run only this schedule's rows again (repeatable), against the references recorded in --results",
    )
    parser.add_argument(
        "--ep", type=int, action="append", choices=EXPERT_PARALLEL, help="run only the rows at this EP (repeatable)"
    )
    options = parser.parse_args(argv)
    stem = "moe_matrix_launcher" if options.launcher else "moe_matrix"
    options.results = options.results or ROOT / "docs" / f"{stem}.jsonl"
    options.table = options.table or ROOT / "docs" / f"{stem}.md"
    if options.launcher:
        name = f"launcher-mcore-{importlib.metadata.version('megatron-core')}"
    else:
        name = options.megatron_lm.resolve().name
    done_rows = read_results(options.results)
    if options.retry_failed and not options.table_only:
        done_rows = {key: row for key, row in done_rows.items() if row["result"] != "failed"}
    if options.only and not options.table_only:
        done_rows = {
            key: row
            for key, row in done_rows.items()
            if not (key[0] == name and RESUMED.get(row["schedule"], row["schedule"]) in options.only)
        }
    if not options.table_only:
        with tempfile.TemporaryDirectory(prefix="moe-matrix-") as folder:
            scratch = Path(folder)
            root = None
            if not options.launcher:
                root = scratch / name
                shutil.copytree(options.megatron_lm, root, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
                for path in (root, *root.rglob("*")):
                    path.chmod(path.stat().st_mode | 0o200)
            run_matrix(
                Launch(root, name, options.lock),
                scratch,
                options.results,
                done_rows,
                options.only,
                tuple(options.ep or EXPERT_PARALLEL),
            )
        done_rows = read_results(options.results)  # with the rows another matrix (another Python) appended meanwhile
    options.results.write_text("".join(json.dumps(row) + "\n" for row in done_rows.values()))  # superseded out
    options.table.write_text(table(done_rows, options.launcher))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
