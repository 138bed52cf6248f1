"""Both runs of a scaled line through Megatron-LM's own ``pretrain()`` on CPU, and what they logged.

Each run spawns its own gloo processes (``pretrain()`` owns a process's global state), their output
kept in a log file that is shown only when the run fails;
each logs one metrics line per iteration (loss, grad norm, skipped step), which the verdict compares.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from ..training.measured import read_metrics

# A scaled run trains in well under a minute here; one still running after this is stuck (e.g. a data split left
# empty makes Megatron-LM's data loader loop forever without waiting on any peer, which no timeout sees).
DEADLINE_S = 900.0


class RunFailed(RuntimeError):
    """A run ended without training: its log's tail says why."""


def train(
    argv: list[str], processes: int, name: str, folder: Path, timeout_s: float, label: str | None = None
) -> tuple[list[dict], float]:
    """Run ``pretrain()`` with ``argv`` (checked) on ``processes`` gloo processes; (its metrics lines, seconds).

    ``name`` names its files in ``folder``; ``label`` (default ``name``) names the run to the user.
    """
    from .launch import spawn_cpu

    metrics, log = folder / f"{name}.jsonl", folder / f"{name}.log"
    start = time.perf_counter()
    with _output_to(log):
        code = spawn_cpu(argv, processes, str(metrics), timeout_s=timeout_s, deadline_s=DEADLINE_S)
    seconds = time.perf_counter() - start
    if code != 0 or not metrics.exists():
        why = "it exited with status 0 but logged no iteration" if code == 0 else f"exit status {code}"
        raise RunFailed(f"the run with {label or name} failed ({why}); the end of its log:\n{_tail(log)}")
    return read_metrics(metrics), seconds


@contextlib.contextmanager
def _output_to(log: Path):
    """This process's and its children's stdout and stderr into ``log`` (file descriptors 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log.open("w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _tail(log: Path, lines: int = 40) -> str:
    """What says why a run failed: the launcher's report of the first rank that failed or stalled (with its
    traceback), else the end of the log; without Megatron-LM's argument dump and warnings either way. The other
    ranks go on printing after one failed, so the end of the log need not hold the cause."""
    text = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if " ..." not in line and "Warning" not in line and "warnings.warn" not in line
    ]
    reports = [
        index
        for index, line in enumerate(text)
        if line.startswith(("megatron-zb train: rank ", "megatron-zb train: timeout", "megatron-zb train: deadline"))
    ]
    if reports:
        return "\n".join(text[reports[0] : reports[0] + 2 * lines])
    return "\n".join(text[-lines:])
