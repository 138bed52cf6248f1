"""BitPipe through the launcher: losses equal megatron-core's 1F1B, replicas stay bit-identical, resume exact."""

from __future__ import annotations

import pytest

from megatron_zb.testing.pool import WorkerPool
from megatron_zb.training.arguments import parse

TOLERANCE = 1e-5
MODEL = (
    "--cpu --cpu-procs 4 --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
    "--mock-data --micro-batch-size 2 --global-batch-size 16 --train-iters 4 --lr 3e-3 --hidden-dropout 0 "
    "--attention-dropout 0 --log-interval 2 --seed 7 --clip-grad 0.05"
)
SETTINGS = {
    "pp4": "--pipeline-model-parallel-size 4",
    "pp2xdp2-distopt": "--pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce",
}


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def train_case(args) -> dict:
    """Train as ``run_rank`` does; then every replica pair compares its two copies' parameters bit for bit."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.megatron.install import configure, install
    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.training.build import build, init_parallel
    from megatron_zb.training.loop import train

    install()
    configure(args.zero_bubble)
    init_parallel(args, torch.device("cpu"))
    try:
        trainee = build(args, torch.device("cpu"), gloo=True)
        rows = train(args, trainee)
        identical = {}
        if args.zero_bubble is not None:
            from megatron_zb.runtime.dp.replicas import replica_groups
            from megatron_zb.schedule import ScheduleSpec
            from megatron_zb.schedule import build as build_schedule

            pp = parallel_state.get_pipeline_model_parallel_world_size()
            schedule = build_schedule(args.zero_bubble.schedule, ScheduleSpec(pp, pp))
            rank = parallel_state.get_pipeline_model_parallel_rank()
            groups = replica_groups(schedule, parallel_state.get_pipeline_model_parallel_group())
            for pair in schedule.shared:  # in one order on every rank: the pair's two ranks meet per block
                mine = [schedule.placements[pipe].blocks[stage] for pipe, stage in pair]
                chunk = next((chunk for owner, chunk in mine if owner == rank), None)
                if chunk is None:
                    continue
                flat = torch.cat([p.detach().reshape(-1).float() for p in trainee.chunks[chunk].parameters()])
                both = [torch.empty_like(flat) for _ in range(2)]
                dist.all_gather(both, flat, group=groups[chunk])
                identical[(rank, chunk)] = torch.equal(both[0], both[1])
    finally:
        destroy_model_parallel()
    return {"losses": {row["iteration"]: row["loss"] for row in rows if row["loss"] is not None}, "same": identical}


def run(pool: WorkerPool, argv: str) -> tuple[dict[int, float], dict]:
    results = pool.run(train_case, args=parse(f"{MODEL} {argv}".split()))
    found = [result["losses"] for result in results if result["losses"]]
    assert found and all(one == found[0] for one in found)
    same = {key: value for result in results for key, value in result["same"].items()}
    return found[0], same


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bitpipe_trains_like_megatron_core_1f1b_with_identical_replicas(pool: WorkerPool, setting: str) -> None:
    flags = SETTINGS[setting]
    reference, _ = run(pool, flags)  # megatron-core's own 1F1B
    for name in ("bitpipe", "bitpipe-zb"):
        ours, same = run(pool, f"{flags} --pipeline-schedule {name}")
        worst = max(abs(ours[i] - reference[i]) / abs(reference[i]) for i in reference)
        assert sorted(ours) == sorted(reference) and worst <= TOLERANCE, f"{name}: {worst:.2e}"
        assert same and all(same.values()), f"{name}: replicas differ after training: {same}"


def test_bitpipe_resumes_exactly(pool: WorkerPool, tmp_path) -> None:
    flags = f"{SETTINGS['pp4']} --enable-bitpipe-schedule"
    full, _ = run(pool, flags)
    saved = tmp_path / "checkpoints"
    run(pool, f"{flags} --exit-interval 2 --save {saved}")
    resumed, same = run(pool, f"{flags} --load {saved}")
    assert sorted(resumed) == [3, 4] and all(resumed[i] == full[i] for i in resumed)
    assert all(same.values())


def test_trace_shows_the_second_half_sync_before_the_last_backward(pool: WorkerPool, tmp_path) -> None:
    """The eager sync: on the end ranks the second-half blocks' replica all-reduce runs before the last backward."""
    import json

    trace = tmp_path / "trace.json"
    run(pool, f"{SETTINGS['pp4']} --pipeline-schedule bitpipe --trace-file {trace}")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") in ("X", "i") and "args" in e]
    last = max(e["args"].get("iteration", 0) for e in events)
    for rank, second_half in ((0, "REPLICA_SYNC s7"), (3, "REPLICA_SYNC s7 d1")):
        mine = [e for e in events if e["tid"] in (rank, 1000 + rank) and e["args"].get("iteration", last) == last]
        syncs = [e for e in mine if e["cat"] == "REPLICA_SYNC"]
        assert len(syncs) == 4, rank  # one per chunk, each with its copy on the partner
        sync = next(e for e in syncs if e["name"] == second_half)
        last_backward = max(e["ts"] for e in mine if e["cat"] == "BW")
        assert sync["ts"] < last_backward, rank
