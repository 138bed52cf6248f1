"""Breadth-first schedules through the launcher train the model megatron-core's 1F1B trains.

pp=2 x dp=2 with the distributed optimizer (each chunk's gradients reduce-scattered at its
REDUCE_GRAD, overlapping the passes after it) and pp=4, two chunks per rank, one or two
breadth-first groups; losses equal to megatron-core's own 1F1B (no schedule flag) to 1e-5.
"""

from __future__ import annotations

import pytest

from megatron_zb.testing.launcher import pool_losses
from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import parse

TOLERANCE = 1e-5
MODEL = (
    "--cpu --cpu-procs 4 --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
    "--mock-data --micro-batch-size 2 --train-iters 4 --lr 3e-3 --hidden-dropout 0 --attention-dropout 0 "
    "--log-interval 2 --seed 7"
)
SETTINGS = {
    "pp2xdp2-distopt": "--pipeline-model-parallel-size 2 --global-batch-size 16 --use-distributed-optimizer "
    "--overlap-grad-reduce",
    "pp4": "--pipeline-model-parallel-size 4 --global-batch-size 16",
}


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def losses(pool: WorkerPool, argv: str) -> dict[int, float]:
    return pool_losses(pool, parse(f"{MODEL} {argv}".split()))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_breadth_first_trains_like_megatron_core_1f1b(pool: WorkerPool, setting: str) -> None:
    flags = SETTINGS[setting]
    reference = losses(pool, flags)  # megatron-core's own 1F1B
    assert sorted(reference) == list(range(1, 5)) and reference[4] < reference[1]
    runs = {
        "breadth-first": f"{flags} --pipeline-schedule breadth-first",
        "breadth-first-zb": f"{flags} --pipeline-schedule breadth-first-zb",
        "breadth-first-zb, two groups": f"{flags} --pipeline-schedule breadth-first-zb --depth-first-micro-batches 2",
    }
    for label, argv in runs.items():
        ours = losses(pool, argv)
        worst = max(abs(ours[i] - reference[i]) / abs(reference[i]) for i in reference)
        assert sorted(ours) == sorted(reference) and worst <= TOLERANCE, f"{label}: {worst:.2e}"


ZERO3 = "--pipeline-model-parallel-size 2 --global-batch-size 16 --use-torch-fsdp2"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero3_trains_like_megatron_core_1f1b(pool: WorkerPool, tied: bool) -> None:
    """pp=2 x dp=2, chunks sharded with FSDP2: the runtime gathers, releases and reduces where the plan says."""
    untie = "" if tied else " --untie-embeddings-and-output-weights"
    reference = losses(pool, "--pipeline-model-parallel-size 2 --global-batch-size 16" + untie)
    for name in ("breadth-first", "breadth-first-zb", "zb-1p"):
        ours = losses(pool, f"{ZERO3}{untie} --pipeline-schedule {name}")
        worst = max(abs(ours[i] - reference[i]) / abs(reference[i]) for i in reference)
        assert sorted(ours) == sorted(reference) and worst <= TOLERANCE, f"{name}: {worst:.2e}"


def test_measured_trace_shows_each_chunks_gathers_and_reduction(pool: WorkerPool, tmp_path) -> None:
    """The traced iteration has every planned UNSHARD/RESHARD/REDUCE_GRAD of each rank, at its place in the order:
    a chunk's gradients reduced once, its weights gathered for the forward window and again for the backward
    window (the last chunk of the forward sweep keeps them through the turn), each gather issued before the
    compute pass ahead of the window's first pass (prefetch 1)."""
    import json

    from megatron_zb.schedule import ScheduleSpec, build
    from megatron_zb.schedule.lower import DataParallel, lower

    trace = tmp_path / "trace.json"
    losses(pool, f"{ZERO3} --pipeline-schedule breadth-first-zb --trace-file {trace}")
    events = json.loads(trace.read_text())["traceEvents"]
    last = max(e["args"].get("iteration", 0) for e in events if e.get("ph") in ("X", "i") and "args" in e)
    planned = lower(build("breadth-first-zb", ScheduleSpec(2, 4, 2)), DataParallel(gather="windows"))
    for rank in (0, 1):
        mine = [e for e in events if e.get("ph") in ("X", "i") and e.get("cat") not in ("collective", "span")
                and e["tid"] in (rank, 1000 + rank) and e["args"].get("iteration", last) == last]  # fmt: skip
        mine.sort(key=lambda e: e["ts"])
        names = [e["name"] if e["cat"] in ("UNSHARD", "RESHARD", "REDUCE_GRAD") else e["name"].split()[0] for e in mine]
        expected = [str(p) if not p.kind.is_compute else p.kind.value for p in planned.orders[rank]]
        assert names == expected, rank
        reductions = [e for e in mine if e["cat"] == "REDUCE_GRAD"]
        assert len(reductions) == 2 and all(e["tid"] == 1000 + rank for e in reductions)
