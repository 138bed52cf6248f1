"""``--cpu`` ranks are forks of a fork server (``pretrain_gpt.start_ranks``), which outlives one start:
each rank takes its launcher's environment, stdout and stderr as they are when it starts."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from megatron_zb.pretrain_gpt import start_ranks
from megatron_zb.testing.launcher import launcher_probe

NAME = "MZB_RANK_START_PROBE"


@contextlib.contextmanager
def stdout_to(log: Path):
    """This process's file descriptor 1 into ``log``, as verify keeps each Megatron-LM run's output."""
    sys.stdout.flush()
    saved = os.dup(1)
    with log.open("w") as file:
        os.dup2(file.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def started(folder: Path, processes: int, log: Path) -> list[str]:
    with stdout_to(log):
        context = start_ranks(launcher_probe, (str(folder), NAME), processes)
        while not context.join():
            pass
    return [(folder / str(rank)).read_text() for rank in range(processes)]


def test_ranks_take_the_launchers_environment_and_stdout_as_they_are_at_their_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NAME, raising=False)
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    assert started(tmp_path, 1, first) == ["(unset)"]  # the fork server runs from here on (or ran before)
    monkeypatch.setenv(NAME, "set later")
    assert started(tmp_path, 2, second) == ["set later"] * 2
    assert sorted(second.read_text().splitlines()) == ["rank 0: set later", "rank 1: set later"]
    assert first.read_text().splitlines() == ["rank 0: (unset)"]
