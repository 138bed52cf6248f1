"""The profiler measures the expert-parallel all-to-all inside the passes (T_a2a), on two gloo ranks.

One small case: a four-layer GPT whose first layer is MoE, ep=2 and the alltoall dispatcher (each
rank holds two of four experts, its tokens cross ranks in the dispatch and combine), one
microbatch's F and BW timed by a ``PassProfiler``. The forward all-to-alls are timed in F, their
backward in BW; the cost model every rank agrees on carries each direction's mean, positive and
below T_F and T_B, which include them (the fused BW's all-to-all counted in its B share).
"""

from __future__ import annotations

import pytest
import torch

from megatron_zb.runtime.expert_comm import WRAPPED

SEQ, BATCH, VOCAB, HIDDEN = 8, 2, 32, 16
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def pool(worker_pools):
    return worker_pools.get(2)


def test_profiler_measures_the_all_to_all_inside_f_and_b(pool):
    results = pool.run(profiled_moe_passes)
    for rank, result in enumerate(results):
        assert result["hooked"] == sorted(WRAPPED), rank  # recorded in the registry, and undone
        forward, backward = result["a2a"]
        assert 0 < forward < result["seconds"][0], rank  # inside F, and not all of it
        assert 0 < backward < result["seconds"][1], rank
        assert result["a2a_outside"] == 0.0, rank  # nothing is counted with no pass running
        assert result["restored"], rank
    assert results[0]["costs"] == results[1]["costs"]  # agreed: averaged over both ranks
    t_f, t_b, t_a2a, t_a2a_b = results[0]["costs"]
    assert 0 < t_a2a < t_f and 0 < t_a2a_b < t_b
    for direction, measured in enumerate((t_a2a, t_a2a_b)):  # each direction's mean over both ranks
        assert measured == pytest.approx(sum(result["a2a"][direction] for result in results) / 2)


def profiled_moe_passes() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_zb import patching
    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.runtime import expert_comm
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.schedule import Schedule
    from megatron_zb.schedule.ir import BW, F
    from megatron_zb.schedule.placement import linear

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    originals = {name: getattr(token_dispatcher, name) for name in expert_comm.WRAPPED}
    try:
        model = _moe_gpt()
        generator = torch.Generator().manual_seed(10 + dist.get_rank())  # each rank its own tokens
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).sum().backward()  # warm-up, no meter
        profiler, kept = PassProfiler(), {}
        profiler.start()

        def forward(_) -> None:
            kept["loss"] = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).sum()

        profiler.run(F(0, 0), 0, forward, None)
        profiler.run(BW(0, 0), 0, lambda _: kept.pop("loss").backward(), None)
        with expert_comm.metering(profiler.now) as outside:
            pass
        schedule = Schedule("one", (linear(1),), 1, ((F(0, 0), BW(0, 0)),))
        costs = profiler.cost_model(schedule, parallel_state.get_pipeline_model_parallel_group(), (SEQ, BATCH, HIDDEN))
        hooked = sorted(patch.name for patch in patching.applied(patching.MEGATRON) if patch.owner is token_dispatcher)
        for patch in [patch for patch in patching.applied(patching.MEGATRON) if patch.owner is token_dispatcher]:
            patching.revert(patch)
        return {
            "hooked": hooked,
            "a2a": [record.a2a for record in profiler.records],
            "seconds": [record.end - record.start for record in profiler.records],
            "a2a_outside": outside.seconds,
            "costs": (costs.t_f[0], costs.t_b[0], costs.t_a2a[0], costs.t_a2a_b[0]),
            "restored": all(getattr(token_dispatcher, name) is fn for name, fn in originals.items()),
        }
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        destroy_model_parallel()


def _moe_gpt():
    from megatron_zb.testing.moe import moe_config, moe_gpt_stage

    config = moe_config(
        num_layers=4,
        moe_layer_freq=[1, 0, 0, 0],  # one MoE layer: the all-to-all is a small part of the passes
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_ffn_hidden_size=24,
    )
    return moe_gpt_stage(config, 0, VOCAB, SEQ)  # one stage: the embedding and the loss


def test_a_schedule_lowered_with_all_to_alls_runs_and_equals_the_reference(pool):
    """pp=2, zb-1p planned with an all-to-all cost: the executor walks the A2A actions (running nothing:
    this toy model has no MoE layer, so nothing is measured in them) and the result equals the reference."""
    results = pool.run(lowered_toy_gpt, m=3)
    for rank, result in enumerate(results):
        assert result["kinds"]["A2A_F"] == result["kinds"]["F"] == 3, rank
        assert result["kinds"]["A2A_B"] == result["kinds"]["B"] == 3, rank
        assert result["a2a"] == 0.0, rank
        assert result["compared"] > 0 and result["worst_grad"] <= 1e-5, rank
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5), rank
    assert [len(result["losses"]) for result in results] == [0, 3]  # the last stage's rank has the losses


def lowered_toy_gpt(m: int) -> dict:
    from collections import Counter

    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.schedule import CostModel
    from megatron_zb.testing.parallel import compare_to_blocks, init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT, forward_step, reference_step

    init_parallel(pp=2)
    toy, profiler = ToyGPT(), PassProfiler()
    runner = ForwardBackward("zb-1p", costs=CostModel(2, t_a2a=0.3), timeout_s=60, profiler=profiler)
    schedule = runner.schedule_for(2, m)
    config = toy.config(2, schedule.chunks)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    [chunk] = toy.chunks(config, schedule, rank)
    batches = toy.batches(m)
    profiler.start()
    losses = runner(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=chunk,
        num_microbatches=m,
        seq_length=toy.seq,
        micro_batch_size=toy.micro_batch,
    )
    blocks = toy.all_blocks(config, schedule.placement)
    reference = reference_step(blocks, batches)
    worst, compared = compare_to_blocks([chunk], blocks, schedule, rank)
    return {
        "kinds": Counter(record.pass_.kind.value for record in profiler.records),
        "a2a": sum(record.a2a for record in profiler.records),
        "losses": [float(d["lm loss"][0]) for d in losses],
        "reference": reference if losses else [],
        "worst_grad": worst,
        "compared": compared,
    }
