"""The test pool starts even when the port it picked is taken before rank 0 binds it.

``_free_port`` releases the port it found; another process (a second pytest worker's pool, a
test's own subprocess) can take it before rank 0's store binds it. The pool then retries on a
new port instead of leaving the other ranks waiting for rank 0 until the case times out.
"""

from __future__ import annotations

import os
import socket

from megatron_zb.testing import pool as pool_module


def process_id() -> int:
    return os.getpid()


def test_a_taken_port_is_retried_on_a_new_one(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = [port]
        picked: list[int] = []
        free_port = pool_module._free_port

        def first_taken() -> int:
            picked.append(ports.pop() if ports else free_port())
            return picked[-1]

        monkeypatch.setattr(pool_module, "_free_port", first_taken)
        pool = pool_module.WorkerPool(2, timeout_s=120)
        try:
            ranks = pool.run(process_id)
        finally:
            pool.close()
    assert len(set(ranks)) == 2
    assert len(picked) == 2 and picked[0] == port != picked[1]
