"""What the runtime derives from a schedule follows the schedule: re-planned, broadcast, or both.

Two bugs of the caches this replaced: a post-validation prefix keyed by ``id()`` of a lowered
schedule outlived a re-plan, so a new schedule allocated at a reused id ran with the old one's
prefix; and the schedule rank 0 broadcast (CP-SAT refinement, re-planning) arrived without
``shared``, so BitPipe lost its REPLICA_SYNC and the two copies of a block drifted apart. The
distributed cases run on two gloo processes; ``id`` reuse is forced, not left to CPython.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_zb.schedule import PassKind, ScheduleSpec, build
from megatron_zb.schedule.lower import DataParallel, lower
from megatron_zb.schedule.schedule_file import read_json
from megatron_zb.schedule.speculation import speculation
from megatron_zb.testing.pool import WorkerPool

M = 2
ONE_F_ONE_B = ["F0 F1 BW0 BW1", "F0 BW0 F1 BW1"]  # rank 1 checks the pending step after one forward
GPIPE = ["F0 F1 BW0 BW1", "F0 F1 BW0 BW1"]  # ... and here after two


def schedule_json(orders: list[str]) -> str:
    """A pp=2 schedule file: each rank's passes on its stage, e.g. ``F0 BW0`` (microbatch after the kind)."""
    ranks = [
        [{"pass": item.rstrip("0123456789"), "stage": stage, "microbatch": int(item[-1])} for item in order.split()]
        for stage, order in enumerate(orders)
    ]
    return json.dumps({"pp": 2, "microbatches": M, "ranks": ranks})


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(2)


class Pipeline:
    """Stands in for a pipeline process group: a rank, hashable (no collectives: no ``shared`` blocks here)."""

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def test_a_replan_drops_every_run_plan_of_the_old_schedule():
    from megatron_zb.runtime.run_plan import RunPlans, Setting

    plans, pipeline, setting = RunPlans(), Pipeline(1), Setting(2, M, chunks=None)
    old, new = read_json(schedule_json(ONE_F_ONE_B), "1f1b"), read_json(schedule_json(GPIPE), "gpipe")
    plans.schedule(setting, lambda: old)
    before = plans.run_plan(setting, DataParallel(), pipeline, None)
    assert before.prefix_check(lambda: False).passes == 1
    plans.replan(setting, new)
    after = plans.run_plan(setting, DataParallel(), pipeline, None)
    assert after is not before and after.schedule is new
    assert after.speculation == speculation(lower(new, DataParallel()))
    assert after.prefix_check(lambda: False).passes == 2
    assert [p.kind for p in after.rank_plan(False).passes[:3]] == [PassKind.F, PassKind.F, PassKind.BW]
    plans.drop()
    with pytest.raises(KeyError):  # nothing left to derive from: the schedule is planned again first
        plans.run_plan(setting, DataParallel(), pipeline, None)


def settle_points(first: str, second: str, path: str) -> list[int]:
    """Two calls with a post-validated step pending, the schedule file replaced and ``set_costs`` between.

    Every schedule gets the same ``id`` (as a reused address would give it). Returns, per call, how
    many forwards this rank ran when it checked the pending step.
    """
    import shutil

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    from megatron_zb.optimizer import CONFIG_ATTRIBUTE
    from megatron_zb.runtime import ForwardBackward, forward_backward
    from megatron_zb.schedule import CostModel
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT, forward_step

    init_parallel(pp=2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    forwards, settled = [0], []

    def counted_step(data_iterator, model):
        forwards[0] += 1
        return forward_step(data_iterator, model)

    class PendingStep:
        """A post-validated optimizer step that is always pending and never redone."""

        pending = True

        def settle(self) -> bool:
            settled.append(forwards[0])
            return False

    forward_backward.id = lambda _: 0  # a module global shadows the builtin: every schedule at one address
    try:
        toy, runner = ToyGPT(), None
        for source in (first, second):
            if rank == 0:
                shutil.copy(source, path)
            dist.barrier()
            if runner is None:
                runner = ForwardBackward(f"file:{path}", timeout_s=60)
                chunks = toy.chunks(toy.config(2, 1), runner.schedule_for(2, M), rank)
                setattr(get_model_config(chunks[0]), CONFIG_ATTRIBUTE, PendingStep())
            else:
                runner.set_costs(CostModel(2))  # re-plan: the file is read again
            forwards[0] = 0
            batches = toy.batches(M)
            runner(
                forward_step_func=counted_step,
                data_iterator=iter(batches),
                model=chunks,
                num_microbatches=M,
                seq_length=toy.seq,
                micro_batch_size=toy.micro_batch,
            )
            dist.barrier()
    finally:
        del forward_backward.id
    return settled


def test_a_replanned_schedule_at_a_reused_id_checks_at_its_own_prefix(pool: WorkerPool, tmp_path):
    first, second = tmp_path / "1f1b.json", tmp_path / "gpipe.json"
    first.write_text(schedule_json(ONE_F_ONE_B))
    second.write_text(schedule_json(GPIPE))
    results = pool.run(settle_points, first=str(first), second=str(second), path=str(tmp_path / "plan.json"))
    # rank 0 checks after its two forwards in both; rank 1 after one in 1F1B and two in GPipe, not 1F1B's one
    assert results == [[2, 2], [1, 2]]


def bitpipe_gradients(name: str, m: int) -> dict:
    """One training call of ``name`` planned on rank 0 and broadcast; each of this rank's blocks' gradients."""
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.parallel import gradient, init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    runner = ForwardBackward(name, refine_seconds=0.01, timeout_s=60)  # refinement: rank 0 plans, all receive
    schedule = runner.schedule_for(2, m)
    toy = ToyGPT()
    chunks = toy.chunks(toy.config(2, schedule.chunks), schedule, rank)
    toy.step(runner, chunks, toy.batches(m))
    grads = {}
    for pipe, placement in enumerate(schedule.placements):
        for stage, (owner, chunk) in enumerate(placement.blocks):
            if owner == rank:
                flat = torch.cat([gradient(p).reshape(-1) for p in chunks[chunk].parameters()])
                grads[pipe, stage] = flat.tolist()
    return {"shared": schedule.shared, "grads": grads}


@pytest.mark.parametrize("name", ["bitpipe", "bitpipe-zb"])
def test_a_broadcast_bitpipe_schedule_keeps_its_replica_sync(pool: WorkerPool, name: str):
    m = 4
    shared = build(name, ScheduleSpec(2, m)).shared
    results = pool.run(bitpipe_gradients, name=name, m=m)
    grads = {block: grad for result in results for block, grad in result["grads"].items()}
    for first, second in shared:  # REPLICA_SYNC summed both copies' gradients: equal to the bit
        assert grads[first] == grads[second], f"{name}: the copies {first} and {second} hold different gradients"
    assert [result["shared"] for result in results] == [shared, shared]


def replan_bitpipe_zb(m: int) -> dict:
    """Re-plan bitpipe-zb from costs under which another order is faster (rank 0 decides, all receive)."""
    import torch.distributed as dist

    from megatron_zb.runtime import replan
    from megatron_zb.schedule import CostModel

    current = build("bitpipe-zb", ScheduleSpec(2, m))
    measured = CostModel(2, t_f=(3e-3, 1e-3), t_b=(3e-3, 1e-3), t_w=(0.9e-3, 0.3e-3), t_comm=0.5e-3)  # seconds
    agreed = replan.agreed_cost_model
    replan.agreed_cost_model = lambda *_, **__: measured  # what timing the window would have agreed on
    try:
        replanner = replan.Replanner(replan.ReplanWindow(1, 1))
        chosen, _ = replanner.replan(
            current,
            None,
            lambda costs: build("bitpipe-zb", ScheduleSpec(2, m, costs=costs)),
            dist.group.WORLD,
            (16, 2, 32),
            torch.float32,
        )
    finally:
        replan.agreed_cost_model = agreed
    return {"replaced": replanner.report.replaced, "new_orders": chosen.orders != current.orders, "chosen": chosen}


def test_a_replanned_bitpipe_schedule_keeps_its_shared_blocks(pool: WorkerPool):
    results = pool.run(replan_bitpipe_zb, m=4)
    current = build("bitpipe-zb", ScheduleSpec(2, 4))
    for result in results:
        assert result["replaced"] and result["new_orders"]
        assert result["chosen"].shared == current.shared
        assert result["chosen"].placements == current.placements
