"""``--cpu`` ranks are forks of a fork server (``training.spawn.start_ranks``), which outlives one start:
each rank takes its launcher's environment, stdout and stderr as they are when it starts."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from megatron_zb.testing.launcher import launcher_probe
from megatron_zb.training.spawn import RANK_IMPORTS, start_ranks

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


def test_the_fork_server_imports_from_the_launchers_path_and_follows_it_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a Megatron-LM checkout first on the launcher's path must win over the installed megatron-core in
    every rank (Python's forkserver ignores the path it is given); a second checkout later in the same
    process gets a server of its own."""
    from megatron_zb.testing.launcher import preloaded_probe

    module = "mzb_fork_server_probe"
    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        (root / module).mkdir(parents=True)
        (root / module / "__init__.py").write_text("")

    def preloaded(root: Path) -> list[str]:
        monkeypatch.syspath_prepend(str(root))
        context = start_ranks(preloaded_probe, (str(tmp_path), module), 2, (*RANK_IMPORTS, module))
        while not context.join():
            pass
        return [(tmp_path / str(rank)).read_text() for rank in range(2)]

    assert preloaded(first) == [str(first / module / "__init__.py")] * 2
    assert preloaded(second) == [str(second / module / "__init__.py")] * 2
    assert module not in sys.modules  # the launcher itself never imported it
