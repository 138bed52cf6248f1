"""A rank that stops sending makes its peer fail within the timeout, naming what it waited for.

gloo closes the connection on a timeout, so this module's pool serves this case alone.
"""

from __future__ import annotations

import time

import pytest

from megatron_zb.testing.pool import WorkerPool

TIMEOUT_S = 2.0


def run_with_lost_send(name: str, lost_microbatch: int) -> dict:
    """Rank 0 drops its activation send for one microbatch; every rank reports how it ended."""
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward, P2PError, p2p
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    if rank == 0:
        post = p2p.PipeComm.post

        def lossy_post(self, recvs, sends):
            kept = [(t, tensor) for t, tensor in sends if f"F s0 mb{lost_microbatch}" not in t.what]
            return post(self, recvs, kept)

        p2p.PipeComm.post = lossy_post
    runner = ForwardBackward(name, timeout_s=TIMEOUT_S)
    toy = ToyGPT()
    m = 4
    schedule = runner.schedule_for(2, m)
    chunks = toy.chunks(toy.config(2, schedule.chunks), schedule, rank)
    batches = toy.batches(m)
    start = time.monotonic()
    try:
        toy.step(runner, chunks, batches)
    except P2PError as error:
        return {"error": str(error), "type": type(error).__name__, "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_lost_send_times_out_with_rank_pass_and_microbatch():
    pool = WorkerPool(2, timeout_s=120)
    try:
        sender, receiver = pool.run(run_with_lost_send, name="zb-h1", lost_microbatch=2)
    finally:
        pool.close()
    assert receiver["type"] == "P2PTimeoutError"
    message = receiver["error"]
    for part in ("pipeline rank 1", "activation for F s1 mb2", "from pipeline rank 0", "timed out after"):
        assert part in message, message
    assert receiver["seconds"] < TIMEOUT_S + 10
    # The sender cannot hang either: it fails on its own wait once the receiver is gone.
    assert sender["error"] is not None and "pipeline rank 0" in sender["error"]
    assert sender["seconds"] < 3 * TIMEOUT_S + 10


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_timeout_must_be_positive(timeout_s):
    from megatron_zb.runtime import ForwardBackward

    with pytest.raises(ValueError, match="timeout_s"):
        ForwardBackward("zb-h1", timeout_s=timeout_s)
