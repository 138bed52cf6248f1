"""B/W split of megatron-core MoE layers on CPU: bit-identical to the fused backward.

Everything runs in the pytest process: one gloo rank (tp = ep = pp = 1), megatron-core on CPU,
a small GPTModel with the local spec's SequentialMLP experts. The reference is the same model
backpropagated by plain autograd with no store active (megatron-core's own linear function);
ours is the forward under ``recording``, B under ``deferring`` and then W from the queue.
"""

from __future__ import annotations

import functools

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_zb.runtime import linear_split, te_wgrad
from megatron_zb.runtime.wgrad import WeightGradStore
from megatron_zb.testing import moe as testing_moe
from megatron_zb.testing.parallel import one_gloo_rank

SEQ, BATCH, VOCAB = 8, 2, 32
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu():
    threads = torch.get_num_threads()
    with one_gloo_rank():
        torch.set_num_threads(1)
        linear_split.install()
        yield
        linear_split.uninstall()
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_aux_loss_scale(monkeypatch):
    """megatron-core's class-global aux-loss scale: a plain backward sets it to a 0-d tensor, which a schedule's
    ``set_loss_scale`` (a 1-element tensor, copied in place) then cannot take. Each case starts without one."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)


@functools.cache
def moe_config(dispatcher: str, shared: bool, layer_freq, gate: bool = False, extra: tuple = ()):
    return testing_moe.moe_config(
        **dict(extra),
        num_layers=2,  # one count for every case: megatron-core's aux-loss tracker is sized by the first
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_ffn_hidden_size=24,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=20 if shared else None,
        moe_shared_expert_gate=gate,
        moe_layer_freq=list(layer_freq) if isinstance(layer_freq, tuple) else layer_freq,
    )


def moe_gpt(config):
    return testing_moe.moe_gpt_stage(config, 0, VOCAB, SEQ)  # one stage: the embedding and the loss


def batch() -> dict:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
    }


def loss(model, data: dict) -> torch.Tensor:
    return model(data["tokens"], data["position_ids"], None, labels=data["labels"]).sum()


def grads(model) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def split_linear_weights(model) -> set[str]:
    """Names of the weights megatron-core's linear function multiplies: what the split defers to W."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        names[id(module.weight)]
        for module in model.modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None
    }


EXPERT_BIAS = (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True))
CASES = [
    pytest.param("allgather", False, 1, (), id="allgather"),
    pytest.param("allgather", True, 1, (), id="allgather-shared"),
    pytest.param("alltoall", False, 1, (), id="alltoall"),
    pytest.param("alltoall", True, 1, (), id="alltoall-shared"),
    pytest.param("alltoall", True, (1, 0), (), id="alltoall-shared-dense-layer"),
    pytest.param("allgather", True, (0, 1), (), id="allgather-shared-dense-layer"),
    # the router's expert-bias buffers, which megatron-core creates on the CUDA device
    pytest.param("alltoall", False, 1, EXPERT_BIAS, id="alltoall-sigmoid-expert-bias"),
]


@pytest.mark.parametrize(("dispatcher", "shared", "layer_freq", "extra"), CASES)
def test_moe_split_is_bit_identical_to_fused_backward(dispatcher, shared, layer_freq, extra):
    model, data = moe_gpt(moe_config(dispatcher, shared, layer_freq, extra=extra)), batch()
    assert te_wgrad.delayed_wgrad_layers(model) == []  # MoELayer.backward_dw (AttributeError on 0.16.1) is never called

    loss(model, data).backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)
    deferred = split_linear_weights(model)
    experts = {name for name in deferred if ".experts." in name or ".shared_experts." in name}
    moe_layers = sum(layer_freq) if isinstance(layer_freq, tuple) else 2
    assert len(experts) == moe_layers * (4 * 2 + 2 * shared)  # fc1 and fc2 of 4 experts (and the shared expert)
    assert all(reference[name].any() for name in experts)  # every expert got tokens: its W is not trivially zero
    assert_split_matches(model, data, reference, deferred)


def assert_split_matches(model, data: dict, reference: dict, deferred: set[str]) -> None:
    """F under ``recording``, B deferring: the split weights wait for W, everything else equals the fused backward
    already; after W every gradient does, bit for bit."""

    store = WeightGradStore()
    with store.recording():
        value = loss(model, data)
    with store.deferring((0, 0)):
        value.backward()
    after_b = grads(model)
    assert len(store) == len(deferred)
    for name, grad in after_b.items():
        if name in deferred:
            assert grad is None, f"{name}: weight gradient computed in B"
        else:  # norms, embeddings, the router (its own autograd Function) and the shared-expert gate: in B
            assert grad is not None and torch.equal(grad, reference[name]), name
    assert any(name.endswith("router.weight") for name in after_b if name not in deferred)

    store.run((0, 0))
    store.check_empty()
    for name, grad in grads(model).items():
        assert grad is not None and torch.equal(grad, reference[name]), name


def test_an_expert_without_tokens_gets_a_zero_gradient_in_w():
    """Expert 3 never chosen (its expert bias far below the others'): it runs on no tokens, and its zero weight
    gradient is computed in W, as the fused backward computes it."""
    model, data = moe_gpt(moe_config("alltoall", False, 1, extra=EXPERT_BIAS)), batch()
    for layer in model.decoder.layers:
        layer.mlp.router.expert_bias[3] = -100.0
    loss(model, data).backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)
    idle = [name for name in reference if ".local_experts.3." in name]
    assert len(idle) == 4 and not any(reference[name].any() for name in idle)
    assert_split_matches(model, data, reference, split_linear_weights(model))


def test_shared_expert_gate_stays_in_b():
    model, data = moe_gpt(moe_config("alltoall", True, 1, gate=True)), batch()
    loss(model, data).backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)

    store = WeightGradStore()
    with store.recording():
        value = loss(model, data)
    with store.deferring((0, 0)):
        value.backward()
    gates = [name for name in reference if name.endswith("shared_experts.gate_weight")]
    assert len(gates) == 2
    for name in gates:
        assert torch.equal(model.get_parameter(name).grad, reference[name])
    store.run((0, 0))
    for name, grad in grads(model).items():
        assert torch.equal(grad, reference[name]), name


def test_microbatches_accumulate_bit_identically_in_b_order():
    """Two microbatches: Ws in B order sum the expert gradients as the fused backward does."""
    model = moe_gpt(moe_config("alltoall", True, 1))
    generator = torch.Generator().manual_seed(2)
    datas = [batch(), {**batch(), "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)}]
    for data in datas:
        loss(model, data).backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)

    store = WeightGradStore()
    for mb, data in enumerate(datas):
        with store.recording():
            value = loss(model, data)
        with store.deferring((0, mb)):
            value.backward()
    store.run((0, 0))
    store.run((0, 1))
    for name, grad in grads(model).items():
        assert torch.equal(grad, reference[name]), name


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_runtime_at_pp1_equals_megatron_core_schedule(dispatcher):
    """Our executor (ZB-H1 at pp=1: every B with its W deferred) against megatron-core's own schedule, aux losses
    scaled by the runtime: losses and every gradient bit for bit."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.toy_gpt import forward_step

    model, m = moe_gpt(moe_config(dispatcher, True, 1)), 3
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        batches.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": (torch.rand(BATCH, SEQ, generator=generator) > 0.1).float(),
                "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
            }
        )
    runner = ForwardBackward("zb-h1", timeout_s=60)
    outcome = {}
    for label, function in (("megatron", forward_backward_no_pipelining), ("ours", runner)):
        model.zero_grad(set_to_none=True)
        losses = function(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=BATCH,
        )
        outcome[label] = ([d["lm loss"] for d in losses], grads(model))
    assert runner.last_store.queued == m * len(split_linear_weights(model))
    for ours, theirs in zip(outcome["ours"][0], outcome["megatron"][0], strict=True):
        assert torch.equal(ours, theirs)
    for name, grad in outcome["ours"][1].items():
        assert torch.equal(grad, outcome["megatron"][1][name]), name


# -- expert parallelism: two gloo processes ---------------------------------------------------------
@pytest.fixture(scope="module")
def pool(worker_pools):
    return worker_pools.get(2)


@pytest.mark.parametrize(("dispatcher", "shared"), [("alltoall", True), ("allgather", False)])
def test_expert_parallel_split_is_bit_identical(pool, dispatcher, shared):
    """ep=2 (dp=2): each rank holds two of the four experts; tokens cross ranks in the dispatch and combine
    all-to-alls (all-gather / reduce-scatter), whose backward runs in B. Each rank's own gradients, split and fused."""
    results = pool.run(expert_parallel_case, dispatcher=dispatcher, shared=shared)
    for rank, result in enumerate(results):
        assert result["local_experts"] == 2, rank
        assert result["deferred_in_b"] == [], rank
        assert result["differ"] == [], rank
        assert result["queued"] == result["linears"] > 0, rank


def expert_parallel_case(dispatcher: str, shared: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_zb.process_groups import destroy_model_parallel

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    linear_split.install()
    try:
        model = moe_gpt(moe_config(dispatcher, shared, 1))
        generator = torch.Generator().manual_seed(10 + dist.get_rank())  # each rank its own tokens
        data = {**batch(), "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)}
        loss(model, data).backward()
        reference = grads(model)
        model.zero_grad(set_to_none=True)

        store = WeightGradStore()
        with store.recording():
            value = loss(model, data)
        with store.deferring((0, 0)):
            value.backward()
        deferred = split_linear_weights(model)
        deferred_in_b = [name for name, p in model.named_parameters() if name in deferred and p.grad is not None]
        queued = len(store)
        store.run((0, 0))
        store.check_empty()
        differ = [name for name, grad in grads(model).items() if not torch.equal(grad, reference[name])]
        return {
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "deferred_in_b": deferred_in_b,
            "differ": differ,
            "queued": queued,
            "linears": len(deferred),
        }
    finally:
        linear_split.uninstall()
        MoEAuxLossAutoScaler.main_loss_backward_scale = None  # the plain backward's 0-d tensor (fresh_aux_loss_scale)
        destroy_model_parallel()


def test_overlapped_forward_and_backward_equal_the_plain_passes(pool) -> None:
    """One microbatch's forward beside another's backward (runtime/overlap.py), expert parallelism 2: the losses
    and every gradient equal the same passes one after the other, bit for bit; the backward's collectives ran
    on the twin groups, the forward's on megatron-core's own."""
    results = pool.run(overlapped_case)
    for rank, found in enumerate(results):
        assert found["local_experts"] == 2, rank  # 4 experts over 2 ranks: the all-to-all crosses ranks
        assert found["losses"] == found["reference_losses"], rank
        assert found["differ"] == [], rank
        assert found["twin_calls"] > 0 and found["own_calls"] > 0, (rank, found)


def overlapped_case() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.runtime import overlap

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    linear_split.install()
    pair = overlap.PairCollectives()
    try:
        model = moe_gpt(moe_config("alltoall", True, 1))
        generator = torch.Generator().manual_seed(20 + dist.get_rank())
        data = [{**batch(), "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)} for _ in range(2)]

        def plain() -> tuple[list[float], dict]:
            store, values = WeightGradStore(), []
            for microbatch in (0, 1):  # F0 B0 W0 F1 B1 W1: the order the pair below keeps for the math
                with store.recording():
                    value = loss(model, data[microbatch])
                with store.deferring((0, microbatch)):
                    value.backward()
                store.run((0, microbatch))
                values.append(value.item())
            return values, grads(model)

        reference_losses, reference = plain()
        model.zero_grad(set_to_none=True)

        groups = [
            None,
            parallel_state.get_expert_model_parallel_group(),
            parallel_state.get_expert_tensor_and_model_parallel_group(),
            parallel_state.get_tensor_and_context_parallel_group(),
            parallel_state.get_tensor_model_parallel_group(),
        ]
        twins = overlap.Twins.create(groups)
        calls = {"twin": 0, "own": 0}
        seen = pair._call

        def counted(op, original, bound, args, kwargs):
            side = getattr(overlap._side, "value", None)
            if side is not None:
                calls["twin" if side.twins is not None else "own"] += 1
            return seen(op, original, bound, args, kwargs)

        pair._call = counted
        pair.start()
        store = WeightGradStore()
        with store.recording():
            first = loss(model, data[0])

            def forward() -> torch.Tensor:
                return loss(model, data[1])

            def backward() -> None:
                with store.deferring((0, 0)):
                    first.backward()

            second, _ = overlap.run_pair(forward, backward, twins, pair)
        store.run((0, 0))
        with store.deferring((0, 1)):
            second.backward()
        store.run((0, 1))
        store.check_empty()
        pair.stop()
        differ = [name for name, grad in grads(model).items() if not torch.equal(grad, reference[name])]
        return {
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "losses": [first.item(), second.item()],
            "reference_losses": reference_losses,
            "differ": differ,
            "twin_calls": calls["twin"],
            "own_calls": calls["own"],
        }
    finally:
        if pair.active:
            pair.stop()
        linear_split.uninstall()
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        destroy_model_parallel()
