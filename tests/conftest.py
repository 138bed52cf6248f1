"""Shared by every test module: one gloo worker pool per world size for the whole session.

Starting the processes and importing megatron-core in them is the expensive part of the
suite; a module's ``pool`` fixture takes its pool from ``worker_pools`` (reset first, see
``megatron_zb.testing.pool.reset_worker``) instead of starting its own.

``MZB_ONE_SCHEDULE_PER_SHAPE=1`` (CI's run on a second megatron-core version): a test
parametrized over schedule names (its ``name`` argument) runs one schedule of each shape
(``megatron_zb.testing.shapes``); no megatron-core version changes the order of the passes.
"""

from __future__ import annotations

import os

import pytest

from megatron_zb.testing.pool import SharedPools


@pytest.fixture(scope="session")
def worker_pools():
    pools = SharedPools()
    yield pools
    pools.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("MZB_ONE_SCHEDULE_PER_SHAPE"):
        return
    from megatron_zb.schedule.registry import names
    from megatron_zb.testing.shapes import one_per_shape

    every = set(names())
    kept = set(one_per_shape(sorted(every))) | set(one_per_shape(sorted(every), pp=4, microbatches=8))
    chosen, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        name = params.params.get("name") if params is not None else None
        (dropped if isinstance(name, str) and name in every - kept else chosen).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen
