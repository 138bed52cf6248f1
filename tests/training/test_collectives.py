"""Recording the collectives each rank runs, and finding those between two iterations.

Synthetic records check ``cross_stage``, the gap between iterations and the trace events; two
gloo processes check that the recorder wraps and restores torch.distributed exactly, and, as
the negative control of the optimizer post-validation test, that megatron-core's own
optimizer at pp=2 puts a cross-stage all-reduce (the grad norm) between two iterations.
"""

from __future__ import annotations

import json

import pytest

from megatron_zb.runtime.profiler import PassRecord
from megatron_zb.schedule.ir import BW, B, F, W
from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.collectives import (
    CollectiveRecord,
    SpanRecord,
    collectives_between_iterations,
    cross_stage,
    iteration_gap,
)
from megatron_zb.training.measured import write_measured_trace

STAGES = {0: 0, 1: 1, 2: 0, 3: 1}  # pp=2 x dp=2: global rank -> pipeline stage
M = 4
PASS_KINDS = ("F", "B", "W", "BW")


def test_cross_stage_looks_at_the_group_only():
    assert cross_stage(CollectiveRecord("all_reduce", (0, 1), 0.0, 1.0), STAGES)
    assert cross_stage(CollectiveRecord("all_reduce", (0, 1, 2, 3), 0.0, 1.0), STAGES)
    assert not cross_stage(CollectiveRecord("all_reduce", (0, 2), 0.0, 1.0), STAGES)  # data-parallel
    assert not cross_stage(CollectiveRecord("barrier", (3,), 0.0, 1.0), STAGES)
    with pytest.raises(ValueError, match=r"all_gather on ranks \[0, 5\]: no pipeline stage given for rank 5"):
        cross_stage(CollectiveRecord("all_gather", (0, 5), 0.0, 1.0), STAGES)


# Rank 0 of a pp=2 pipeline: iteration 1 ends with W at 3.0, iteration 2's first F starts at 5.0.
PASSES = [
    PassRecord(1, F(0, 0), 0, 0.0, 1.0),
    PassRecord(1, B(0, 0), 0, 2.0, 2.5),
    PassRecord(1, W(0, 0), 0, 2.5, 3.0),
    PassRecord(2, BW(0, 1), 0, 7.0, 8.0),  # not an F: the gap ends at the F below
    PassRecord(2, F(0, 1), 0, 5.0, 6.0),
]


def collective(start: float, end: float, op: str = "all_reduce", iteration: int = 1) -> CollectiveRecord:
    return CollectiveRecord(op, (0, 1), start, end, iteration=iteration)


def test_collectives_between_iterations_overlap_the_gap():
    assert iteration_gap(PASSES, 1) == (3.0, 5.0)
    inside, posted = collective(3.5, 4.0), collective(4.5, 4.5, "broadcast")
    straddling = [collective(2.9, 3.1, "barrier"), collective(4.9, 5.2, "all_gather", iteration=2)]
    outside = [collective(0.5, 0.6), collective(2.0, 3.0), collective(5.0, 5.5, iteration=2)]
    found = collectives_between_iterations(PASSES, [*outside, inside, posted, *straddling], 1)
    assert found == [inside, posted, *straddling]
    with pytest.raises(ValueError, match="no F pass of iteration 3"):
        iteration_gap(PASSES, 2)
    with pytest.raises(ValueError, match="no pass of iteration 7"):
        collectives_between_iterations(PASSES, [], 7)


def test_trace_holds_two_iterations_collectives_and_spans(tmp_path):
    rank1 = [PassRecord(1, F(1, 0), 0, 1.0, 2.0), PassRecord(2, F(1, 1), 0, 6.0, 7.0)]
    norm = CollectiveRecord("all_reduce", (0, 1), 3.5, 4.0, iteration=1)
    dp = CollectiveRecord("all_reduce", (1, 3), 4.5, 4.5, async_op=True, iteration=2)
    step = SpanRecord("optimizer step", 3.2, 4.2, 1)
    written = write_measured_trace(
        tmp_path / "trace.json",
        [PASSES + [PassRecord(3, F(0, 2), 0, 9.0, 9.5)], rank1],  # iteration 3: left out
        "zb-h1",
        (1, 2),
        collectives_per_rank=[[norm, collective(9.2, 9.3, iteration=3)], [dp]],
        spans_per_rank=[[step], []],
        stage_of_rank=STAGES,
    )
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace == written
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    passes = [(e["tid"], e["name"], e["args"]["iteration"]) for e in events if e["cat"] in PASS_KINDS]
    assert passes == [(0, "F mb0", 1), (0, "B mb0", 1), (0, "W mb0", 1), (0, "F mb1", 2), (0, "BW mb1", 2)] + [
        (1, "F mb0", 1),
        (1, "F mb1", 2),
    ]
    collectives = [e for e in events if e["cat"] == "collective"]
    assert [(e["tid"], e["name"], e["ts"], e["dur"]) for e in collectives] == [
        (0, "all_reduce", 3.5e6, 0.5e6),
        (1, "all_reduce", 4.5e6, 0.0),
    ]
    assert collectives[0]["args"] == {"ranks": [0, 1], "cross_stage": True, "async_op": False, "iteration": 1}
    assert collectives[1]["args"] == {"ranks": [1, 3], "cross_stage": False, "async_op": True, "iteration": 2}
    (span,) = [e for e in events if e["cat"] == "span"]
    assert (span["tid"], span["name"], span["ts"], span["dur"]) == (0, "optimizer step", 3.2e6, pytest.approx(1e6))
    assert trace["otherData"]["iterations"] == [1, 2] and "iteration" not in trace["otherData"]
    process = next(e for e in trace["traceEvents"] if e.get("name") == "process_name")
    assert process["args"]["name"] == "megatron-zb zb-h1 measured iterations 1-2"


def test_trace_refuses_what_it_cannot_show(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(ValueError, match=r"no records of iteration\(s\) 3; records hold iteration\(s\) 1, 2"):
        write_measured_trace(path, [PASSES], "1f1b", (2, 3))
    with pytest.raises(ValueError, match="collectives in a trace need stage_of_rank"):
        write_measured_trace(path, [PASSES], "1f1b", 1, collectives_per_rank=[[collective(3.5, 4.0)]])


# -- two gloo processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


def _attributes() -> dict:
    """Every attribute of the modules the recorder patches, by identity."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from megatron.core.distributed import param_and_grad_buffer

    return {(m.__name__, k): id(v) for m in (dist, c10d, param_and_grad_buffer) for k, v in vars(m).items()}


def wrap_and_restore() -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer

    from megatron_zb.training.collectives import CollectiveRecorder

    rank = dist.get_rank()
    singles = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
    before, original = _attributes(), dist.all_reduce
    recorder = CollectiveRecorder()
    with recorder:
        wrapped = dist.all_reduce is not original and getattr(dist.all_reduce, "_collective_recorder", None) is recorder
        try:
            CollectiveRecorder().start()
            second = "started"
        except RuntimeError as error:
            second = str(error)
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object([None, None], rank)  # all_gather inside: recorded once
        dist.broadcast_object_list([rank], src=0)  # broadcast inside
        dist.all_reduce(torch.ones(1), group=singles[rank], async_op=True).wait()
        recorder.iteration = 2
        with recorder.span("optimizer step"):
            param_and_grad_buffer.dist_all_gather_func(torch.zeros(2), torch.ones(1))  # megatron's alias
            dist.barrier()
    after = _attributes()
    dist.all_reduce(torch.ones(1))  # stopped: not recorded
    return {
        "wrapped": wrapped,
        "second": second,
        "restored": before == after,
        "active": recorder.active,
        "records": [(r.op, r.ranks, r.async_op, r.iteration, r.start <= r.end) for r in recorder.records],
        "spans": [(s.name, s.iteration) for s in recorder.spans],
        "in_span": [r.op for r in recorder.records for s in recorder.spans if s.start <= r.start and r.end <= s.end],
    }


def test_recorder_wraps_and_restores_exactly(pool):
    for rank, result in enumerate(pool.run(wrap_and_restore)):
        assert result["wrapped"] and result["restored"] and not result["active"]
        assert "already wrapped by another active CollectiveRecorder" in result["second"]
        assert result["records"] == [
            ("all_reduce", (0, 1), False, 0, True),
            ("all_gather_object", (0, 1), False, 0, True),
            ("broadcast_object_list", (0, 1), False, 0, True),
            ("all_reduce", (rank,), True, 0, True),
            ("all_gather_into_tensor", (0, 1), False, 2, True),
            ("barrier", (0, 1), False, 2, True),
        ]
        assert result["spans"] == [("optimizer step", 2)]
        assert result["in_span"] == ["all_gather_into_tensor", "barrier"]


def megatron_optimizer_steps(path: str) -> dict:
    """Two 1F1B iterations of a pp=2 toy GPT with megatron-core's optimizer stepping in between."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_zb.compat import optimizer_checks_grad_norm_groups
    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT
    from megatron_zb.training.collectives import CollectiveRecorder
    from megatron_zb.training.measured import gather_trace, write_measured_trace

    init_parallel(pp=2)
    profiler, recorder = PassProfiler(), CollectiveRecorder()
    runner = ForwardBackward("1f1b", timeout_s=60, profiler=profiler)
    toy = ToyGPT(layers=4)
    config = toy.config(2, 1)
    chunks = toy.chunks(config, runner.schedule_for(2, M), parallel_state.get_pipeline_model_parallel_rank())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, params_dtype=torch.float32)
    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    profiler.start()
    with recorder:
        for iteration in (1, 2):
            profiler.iteration = recorder.iteration = iteration
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            toy.step(runner, chunks, toy.batches(M, stream=iteration))
            with recorder.span("optimizer step"):
                succeeded, grad_norm, _ = optimizer.step()
            assert succeeded and grad_norm > 0
    profiler.stop()
    gathered = gather_trace(profiler.records, (1, 2), recorder)
    if gathered is not None:
        write_measured_trace(
            path,
            gathered.passes,
            "1f1b",
            (1, 2),
            collectives_per_rank=gathered.collectives,
            spans_per_rank=gathered.spans,
            stage_of_rank=gathered.stage_of_rank,
        )
    return {
        "passes": profiler.records,
        "collectives": recorder.records,
        "spans": recorder.spans,
        "trace": gathered,
        "checks_norm_groups": optimizer_checks_grad_norm_groups(),
    }


def test_megatron_optimizer_syncs_stages_between_iterations(pool, tmp_path):
    """The negative control: the assertion the post-validation test makes fails on megatron-core's optimizer."""
    path = tmp_path / "trace.json"
    results = pool.run(megatron_optimizer_steps, path=str(path))
    assert results[1]["trace"] is None
    stages = results[0]["trace"].stage_of_rank
    assert stages == {0: 0, 1: 1}
    # The grad-norm all-reduce; megatron-core 0.19 adds, on its first clipped step only, a MAX all-reduce
    # of whether any rank has parameters in a separate grad-norm group (has_grad_norm_group, cached).
    optimizer_reduces = ["all_reduce"] * (2 if results[0]["checks_norm_groups"] else 1)
    for rank, result in enumerate(results):
        between = collectives_between_iterations(result["passes"], result["collectives"], 1)
        crossing = [c for c in between if cross_stage(c, stages)]
        assert [c.op for c in crossing] == optimizer_reduces, f"rank {rank}: {between}"
        (step,) = [s for s in result["spans"] if s.iteration == 1]
        for reduce in crossing:
            assert step.start <= reduce.start and reduce.end <= step.end, "not the optimizer's all-reduce"

    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        track = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
        steps = [e for e in track if e["cat"] == "span"]
        assert [(e["name"], e["args"]["iteration"]) for e in steps] == [("optimizer step", 1), ("optimizer step", 2)]
        last_pass = max(e["ts"] + e["dur"] for e in track if e["cat"] in PASS_KINDS and e["args"]["iteration"] == 1)
        first_f = min(e["ts"] for e in track if e["cat"] == "F" and e["args"]["iteration"] == 2)
        crossing = [
            e for e in track if e["cat"] == "collective" and e["args"]["cross_stage"] and last_pass < e["ts"] < first_f
        ]
        assert [e["name"] for e in crossing] == optimizer_reduces, track
        assert all(e["args"]["ranks"] == [0, 1] and e["args"]["iteration"] == 1 for e in crossing)
