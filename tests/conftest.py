"""Shared by every test module: one gloo worker pool per world size for the whole session.

Starting the processes and importing megatron-core in them is the expensive part of the
suite; a module's ``pool`` fixture takes its pool from ``worker_pools`` (reset first, see
``megatron_zb.testing.pool.reset_worker``) instead of starting its own.
"""

from __future__ import annotations

import pytest

from megatron_zb.testing.pool import SharedPools


@pytest.fixture(scope="session")
def worker_pools():
    pools = SharedPools()
    yield pools
    pools.close()
