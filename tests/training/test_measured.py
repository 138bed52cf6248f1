"""Bubble rate, trace and metrics lines from measured passes.

Synthetic PassRecords check the closed forms and the file contents; two gloo processes check
the collectives (the same numbers on every rank, clocks aligned by a barrier) and one real
profiled zb-h1 iteration on a megatron-core GPT.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_zb.runtime.profiler import PassRecord
from megatron_zb.schedule.ir import BW, B, F, W
from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.measured import (
    MetricsWriter,
    measured_bubble,
    read_metrics,
    write_measured_trace,
)


def record(p, start: float, end: float, iteration: int = 1, chunk: int = 0) -> PassRecord:
    return PassRecord(iteration, p, chunk, start, end)


# Two ranks of a pp=2 pipeline, one microbatch, on a clock that starts at 100 s.
RANK0 = [record(F(0, 0), 100.0, 100.1), record(B(0, 0), 100.4, 100.5), record(W(0, 0), 100.5, 100.6)]
RANK1 = [record(F(1, 0), 100.15, 100.25), record(BW(1, 0), 100.25, 100.4)]


def test_bubble_is_idle_share_of_the_call():
    records = RANK0 + [record(F(0, 1), 50.0, 60.0, iteration=2)]  # another iteration: ignored
    assert measured_bubble(records, 1, 100.0, 100.6) == pytest.approx(1 - 0.3 / 0.6)
    assert measured_bubble(records, 2, 50.0, 60.0) == pytest.approx(0.0)
    assert measured_bubble(records, 3, 0.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="wall_end .* must be after wall_start"):
        measured_bubble(records, 1, 100.6, 100.6)


def test_trace_has_one_track_per_rank_relative_to_the_earliest_pass(tmp_path):
    path = tmp_path / "trace.json"
    noise = [record(F(0, 0), 0.0, 1.0, iteration=2)]
    written = write_measured_trace(path, [RANK0 + noise, RANK1], "zb-h1", iteration=1, extra={"loss": 2.5})
    trace = json.loads(path.read_text())
    assert trace == written
    passes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["name"]) for e in passes] == [
        (0, "F mb0"),
        (0, "B mb0"),
        (0, "W mb0"),
        (1, "F mb0"),
        (1, "BW mb0"),
    ]
    assert [e["ts"] for e in passes] == pytest.approx([0.0, 4e5, 5e5, 1.5e5, 2.5e5])
    assert [e["dur"] for e in passes] == pytest.approx([1e5, 1e5, 1e5, 1e5, 1.5e5])
    assert passes[3]["args"] == {"stage": 1, "chunk": 0, "microbatch": 0, "pipe": 0}
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == {0: "rank 0", 1: "rank 1"}
    process = next(e for e in trace["traceEvents"] if e.get("name") == "process_name")
    assert process["args"]["name"] == "megatron-zb zb-h1 measured iteration 1"
    other = trace["otherData"]
    assert other["schedule"] == "zb-h1" and other["iteration"] == 1 and other["loss"] == 2.5
    assert other["makespan_s"] == pytest.approx(0.6) and other["busy_s"] == pytest.approx([0.3, 0.25])
    assert other["bubble_rate_makespan"] == pytest.approx(1 - 0.55 / 1.2)


def test_trace_needs_one_iteration(tmp_path):
    with pytest.raises(ValueError, match=r"iteration\(s\) 1, 2: pass iteration="):
        write_measured_trace(tmp_path / "t.json", [RANK0 + [record(F(0, 1), 0, 1, iteration=2)]], "1f1b")
    with pytest.raises(ValueError, match=r"iteration\(s\) none"):
        write_measured_trace(tmp_path / "t.json", [RANK0], "1f1b", iteration=5)


def test_metrics_lines_are_flushed_json(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    writer = MetricsWriter(path, enabled=True)
    writer.write(1, torch.tensor(2.5), 0.75, 0.125, "zb-h1", lr=1e-3, grad_norm=torch.tensor([3.0]))
    assert read_metrics(path) == [  # readable before close: each line is flushed
        {
            "iteration": 1,
            "loss": 2.5,
            "iteration_time_s": 0.75,
            "bubble_rate": 0.125,
            "schedule": "zb-h1",
            "lr": 1e-3,
            "grad_norm": 3.0,
        }
    ]
    writer.write(2, math.nan, 0.5, None, "zb-h1")
    writer.close()
    with MetricsWriter(path, enabled=True) as again:  # appends
        again.write(3, 1.0, 0.5, 0.1, "zb-h1")
    lines = read_metrics(path)
    assert [line["iteration"] for line in lines] == [1, 2, 3]
    assert lines[1]["loss"] is None and lines[1]["bubble_rate"] is None


def test_metrics_only_on_the_logging_rank(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert MetricsWriter(path, enabled=False).write(1, 1.0, 0.5, 0.1, "1f1b") is None
    assert not path.exists()
    assert MetricsWriter(path).enabled  # no process group: this process logs


# -- collectives, in two gloo processes ---------------------------------------------------------
@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


def collectives() -> dict:
    import time

    import torch.distributed as dist

    from megatron_zb.training.measured import gather_records, pipeline_bubble

    rank = dist.get_rank()
    group = dist.group.WORLD
    records = [record(F(rank, 0), 0.0, 0.25 * (rank + 1)), record(F(rank, 1), 5.0, 6.0, iteration=2)]
    bubble = pipeline_bubble(records, 1, 0.0, 1.0, group=group)

    # Rank 1's clock runs 1000 s ahead; each rank's pass ended 0.2 s before gathering.
    real = time.perf_counter
    offset = 1000.0 * rank
    time.perf_counter = lambda: real() + offset
    try:
        now = time.perf_counter()
        gathered = gather_records([record(F(rank, 0), now - 0.5, now - 0.2)], 1, group=group)
    finally:
        time.perf_counter = real
    return {"bubble": bubble, "gathered": gathered}


def test_collectives_agree_and_align_clocks(pool):
    results = pool.run(collectives)
    for result in results:
        bubble = result["bubble"]
        assert bubble.per_rank == (0.75, 0.5) and bubble.mean == 0.625 and bubble.max == 0.75
    assert results[1]["gathered"] is None
    gathered = results[0]["gathered"]
    assert [[r.pass_ for r in rank] for rank in gathered] == [[F(0, 0)], [F(1, 0)]]
    starts = [rank[0].start for rank in gathered]
    # Relative to the barrier exit: 0.5 s before it plus the wait there (loose: the machine may be busy).
    assert all(-10.0 < s <= -0.5 for s in starts), starts
    assert abs(starts[0] - starts[1]) < 10.0  # not 1000 s apart


def profiled_iteration(path: str) -> dict:
    """One zb-h1 iteration of a pp=2 GPT with the profiler on; the trace written on rank 0."""
    import time

    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT
    from megatron_zb.training.measured import gather_records, pipeline_bubble, write_measured_trace

    init_parallel(pp=2)
    profiler = PassProfiler()
    runner = ForwardBackward("zb-h1", timeout_s=60, profiler=profiler)
    schedule = runner.schedule_for(2, 4)
    toy = ToyGPT()
    chunks = toy.chunks(toy.config(2, 1), schedule, parallel_state.get_pipeline_model_parallel_rank())
    profiler.start()
    begin = time.perf_counter()
    toy.step(runner, chunks, toy.batches(4))
    end = time.perf_counter()
    bubble = pipeline_bubble(profiler.records, 0, begin, end)
    gathered = gather_records(profiler.records, 0)
    if gathered is not None:
        write_measured_trace(path, gathered, "zb-h1", extra={"bubble_mean": bubble.mean})
    return {"bubble": bubble, "orders": [[str(p) for p in order] for order in schedule.orders]}


def test_profiled_iteration_trace(pool, tmp_path):
    path = tmp_path / "measured.json"
    results = pool.run(profiled_iteration, path=str(path))
    assert results[0]["bubble"] == results[1]["bubble"]
    assert 0.0 <= results[0]["bubble"].max < 1.0
    trace = json.loads(path.read_text())
    passes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank, order in enumerate(results[0]["orders"]):
        names = [e["name"] for e in sorted(passes, key=lambda e: e["ts"]) if e["tid"] == rank]
        assert names == [" ".join(p.split()[::2]) for p in order]  # "F s0 mb3" -> "F mb3", in run order
    assert min(e["ts"] for e in passes) == 0.0
