"""``--cpu`` ranks are forks of a fork server (``pretrain_gpt.start_ranks``), which outlives one start."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_zb.pretrain_gpt import start_ranks
from megatron_zb.testing.launcher import environment_probe


def started(folder: Path, processes: int) -> list[str]:
    context = start_ranks(environment_probe, (str(folder), "MZB_RANK_START_PROBE"), processes)
    while not context.join():
        pass
    return [(folder / str(rank)).read_text() for rank in range(processes)]


def test_ranks_read_the_launchers_environment_as_it_is_at_their_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MZB_RANK_START_PROBE", raising=False)
    assert started(tmp_path, 1) == ["(unset)"]  # the fork server runs from here on, with this environment
    monkeypatch.setenv("MZB_RANK_START_PROBE", "set after the server started")
    assert started(tmp_path, 2) == ["set after the server started"] * 2
