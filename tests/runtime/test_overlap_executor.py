"""The executor runs overlapped F&B pairs (``Schedule.overlapped``) and trains exactly as without them.

Four gloo processes: pp=2 and expert parallelism 2 (each stage's two ranks hold two of the four experts
each, and the alltoall dispatcher's tokens cross between them in every MoE layer). A tiny MoE GPT runs
one schedule twice, as generated and with adjacent F/B (BW) passes of different microbatches paired by
hand: the losses and every gradient are bit-identical, the pairs ran as pairs (the profiler's records
carry their partners, each side's all-to-all metered apart), and a schedule without pairs made no twin
groups.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_zb.runtime import expert_comm, wgrad
from megatron_zb.runtime.wgrad import WeightGradStore
from megatron_zb.schedule import ScheduleError
from megatron_zb.schedule.validate import validate
from megatron_zb.testing.moe import pair_adjacent

SEQ, BATCH, VOCAB, M = 8, 2, 32, 4
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_hand_pairing_keeps_the_pairs_that_can_run():
    from megatron_zb.schedule.registry import ScheduleSpec, build

    schedule = pair_adjacent(build("1f1b", ScheduleSpec(2, M)))
    # rank 1: F0 [BW0 F1] [BW1 F2] [BW2 F3] BW3; rank 0: F0 F1 [BW0 F2] [BW1 F3] BW2 BW3, not [F1 BW0]: rank 1's
    # pair with BW0 needs F1 first, which rank 0 would send only after its pair
    assert [(f.microbatch, b.microbatch) for f, b in schedule.overlapped] == [(1, 0), (2, 1), (3, 2), (2, 0), (3, 1)]
    assert validate(schedule) == []


def test_the_rank_plan_runs_each_pair_as_one_step():
    """Rank 0 of 1F1B with pairs: the pairs' indices, both passes' receives before the first, sends after the
    second; forward-only has no pairs; an executor without ``Pairs`` (or with a profiler that cannot time a
    pair) refuses the plan, and the watchdog names a pair by both passes."""
    from megatron_zb.runtime.executor import Executor, PairStep, plan_rank
    from megatron_zb.schedule.registry import ScheduleSpec, build

    schedule = pair_adjacent(build("1f1b", ScheduleSpec(2, M)))
    plan = plan_rank(schedule, 0)
    assert [str(p) for p in plan.passes[2:4]] == ["BW s0 mb0", "F s0 mb2"]
    assert plan.paired == {2, 4}
    assert [m.consumer for m in plan.receives[2]] == [plan.passes[2]] and plan.receives[3] == ()
    assert plan.sends[2] == () and [m.producer for m in plan.sends[3]] == [plan.passes[3]]
    assert plan_rank(schedule, 0, forward_only=True).paired == frozenset()
    with pytest.raises(ScheduleError, match="no overlap.Pairs"):
        Executor(plan, None, None, None, [], (), torch.float32, torch.device("cpu"))
    with pytest.raises(ScheduleError, match="which object cannot time"):
        Executor(plan, None, None, None, [], (), torch.float32, torch.device("cpu"), profiler=object(), pairs=object())
    assert str(PairStep(*schedule.overlapped[-1])) == "F s0 mb3 beside BW s0 mb1"


def test_each_side_keeps_its_own_w_queue_state():
    """The backward side enters recording first and leaves first, the forward side in between: with one state
    for the process the forward would lose it halfway (its later linears left unsplit); each keeps its own, and
    a fused microbatch's F (``paused``) runs unsplit beside a recording B."""
    store, seen = WeightGradStore(), {}
    b_in, f_in, b_out = threading.Event(), threading.Event(), threading.Event()

    def backward() -> None:
        with wgrad.own_thread(), store.recording():
            b_in.set()
            f_in.wait()
        b_out.set()

    def forward() -> None:
        b_in.wait()
        with wgrad.own_thread(), store.recording():
            f_in.set()
            b_out.wait()
            seen["recording"] = wgrad.active_store()
            with store.paused():
                seen["paused"] = wgrad.active_store()

    threads = [threading.Thread(target=work) for work in (backward, forward)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"recording": store, "paused": None}
    assert wgrad.active_store() is None


def test_each_side_meters_its_own_all_to_all():
    """Both sides' meters active at once: each counts its own calls; a thread with none of its own (autograd's
    device thread on a GPU, running the backward side's backward) counts in the backward side's; a meter opened
    before the pair counts them all."""
    timed = expert_comm._timed(lambda tensor: tensor)
    together = threading.Barrier(2)
    calls: dict[str, int] = {}

    def side(name: str, count: int, backward: bool) -> None:
        with expert_comm.own_thread(backward), expert_comm.metering(time.perf_counter) as meter:
            together.wait()
            for _ in range(count):
                timed(torch.zeros(1))
            if backward:
                foreign = threading.Thread(target=timed, args=(torch.zeros(1),))
                foreign.start()
                foreign.join()
            together.wait()
            calls[name] = meter.calls

    with expert_comm.metering(time.perf_counter) as outer:
        threads = [threading.Thread(target=side, args=args) for args in (("forward", 1, False), ("backward", 2, True))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert calls == {"forward": 1, "backward": 3}
    assert outer.calls == 4


@pytest.fixture(scope="module")
def pool(worker_pools):
    return worker_pools.get(4)


@pytest.mark.parametrize("name", ["1f1b", "zb-1p"])
def test_pairs_train_bit_identically_to_the_plain_schedule(pool, name):
    results = pool.run(paired_and_plain, name=name)
    for rank, found in enumerate(results):
        assert found["local_experts"] == 2, rank  # the all-to-all crosses ranks
        assert found["pairs"] > 0, rank
        assert found["losses"] == found["reference_losses"], rank
        assert len(found["losses"]) == (M if found["last_stage"] else 0), rank
        assert found["compared"] > 0 and found["differ"] == [], rank
        # every split linear deferred alike (1F1B's BWs run megatron-core's own linears: nothing queued)
        assert found["queued"] == found["reference_queued"] and (found["queued"] > 0) == (name == "zb-1p"), rank
        assert found["paired_records"] == 2 * found["pairs"], rank  # both passes of every pair, booked as pairs
        assert found["pair_a2a"] > 0, rank  # each side's all-to-all metered in its own thread
        assert found["plain_twins"] is None and found["paired_twins"], rank


def paired_and_plain(name: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.testing.toy_gpt import forward_step

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2, expert_model_parallel_size=2)
    try:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        model = _stage(pp_rank)
        batches = _batches(parallel_state.get_data_parallel_rank())
        plain = ForwardBackward(name, timeout_s=60)
        schedule = plain.schedule_for(2, M)
        paired = ForwardBackward(name, timeout_s=60, profiler=PassProfiler())
        paired.use_schedule(pair_adjacent(schedule))
        paired.profiler.start()
        outcome = {}
        for label, runner in (("plain", plain), ("paired", paired)):
            model.zero_grad(set_to_none=True)
            losses = runner(
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[model],
                num_microbatches=M,
                seq_length=SEQ,
                micro_batch_size=BATCH,
            )
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            outcome[label] = ([loss["lm loss"].tolist() for loss in losses], grads, runner.last_store.queued)
        records = paired.profiler.records
        differ = [n for n, g in outcome["paired"][1].items() if not torch.equal(g, outcome["plain"][1][n])]
        differ += sorted(set(outcome["paired"][1]) ^ set(outcome["plain"][1]))
        return {
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "pairs": sum(1 for pair in paired.schedule_for(2, M).overlapped if pair[0] in schedule.orders[pp_rank]),
            "last_stage": pp_rank == 1,
            "losses": outcome["paired"][0],
            "reference_losses": outcome["plain"][0],
            "compared": len(outcome["plain"][1]),
            "differ": differ,
            "queued": outcome["paired"][2],
            "reference_queued": outcome["plain"][2],
            "paired_records": sum(1 for record in records if record.partner is not None),
            "pair_a2a": min(record.a2a for record in records if record.partner is not None),
            "plain_twins": plain._pair_groups,
            "paired_twins": paired._pair_groups is not None,
            "world": dist.get_world_size(),
        }
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        destroy_model_parallel()


def _stage(pp_rank: int):
    from megatron_zb.testing.moe import moe_config, moe_gpt_stage

    config = moe_config(
        num_layers=2,  # one MoE layer per stage
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_ffn_hidden_size=24,
        moe_aux_loss_coeff=1e-2,
        moe_shared_expert_intermediate_size=20,
        pipeline_dtype=torch.float32,
    )
    return moe_gpt_stage(config, pp_rank, VOCAB, SEQ)


def _batches(dp_rank: int) -> list[dict]:
    generator = torch.Generator().manual_seed(30 + dp_rank)  # each expert-parallel rank its own tokens
    batches = []
    for _ in range(M):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        batches.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(BATCH, SEQ),
                "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
            }
        )
    return batches
