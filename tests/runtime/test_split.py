"""B/W split of megatron-core's linears and of TE-style delayed layers, against a plain backward.

Everything runs in the pytest process: one gloo rank, megatron-core on CPU. The reference is
always the same layers backpropagated with no store active, i.e. megatron-core's own function.
"""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.transformer import TransformerConfig

from megatron_zb.runtime import linear_split, te_wgrad
from megatron_zb.runtime.wgrad import WeightGradStore
from megatron_zb.testing.parallel import one_gloo_rank

SEQ, BATCH, HIDDEN, FFN = 4, 3, 8, 16
init_method = functools.partial(torch.nn.init.normal_, std=0.3)  # keeps tanh out of saturation
pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu():
    threads = torch.get_num_threads()
    with one_gloo_rank():
        torch.set_num_threads(1)
        linear_split.install()
        yield
        linear_split.uninstall()
        torch.set_num_threads(threads)


# -- helpers ------------------------------------------------------------------------------------
@functools.cache  # one config for every layer (layers only read it)
def config() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True)


def column(in_size: int, out_size: int, bias: bool = True) -> tensor_parallel.ColumnParallelLinear:
    return tensor_parallel.ColumnParallelLinear(
        in_size, out_size, config=config(), init_method=init_method, bias=bias, gather_output=False
    )


def row(in_size: int, out_size: int) -> tensor_parallel.RowParallelLinear:
    return tensor_parallel.RowParallelLinear(
        in_size,
        out_size,
        config=config(),
        init_method=init_method,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )


def mlp(bias: bool = True) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([column(HIDDEN, FFN, bias), row(FFN, HIDDEN)])


def loss(model: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    hidden, _ = model[0](x)
    out, _ = model[1](torch.tanh(hidden))
    return (out**2).sum()


def inputs(count: int, requires_grad: bool = True) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(SEQ, BATCH, HIDDEN, generator=generator).requires_grad_(requires_grad) for _ in range(count)]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def reference(model: torch.nn.Module, xs: list[torch.Tensor], run=loss) -> tuple[dict, list]:
    """Megatron's own backward over ``xs`` (gradients summed); parameters are left without grads."""
    xs = [x.detach().requires_grad_(x.requires_grad) for x in xs]
    for x in xs:
        run(model, x).backward()
    result = grads(model)
    model.zero_grad(set_to_none=True)
    return result, [x.grad for x in xs]


def forward_and_b(store: WeightGradStore, model, x, key, run=loss, fifo_jobs=()) -> None:
    """F under ``recording`` and B under ``deferring(key)``: what the executor does for one microbatch."""
    with store.recording():
        value = run(model, x)
    with store.deferring(key, fifo_jobs):
        value.backward()


def assert_matches(ours: torch.Tensor | None, ref: torch.Tensor) -> None:
    assert ours is not None
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if name.endswith("weight")}


# -- megatron-core linears ----------------------------------------------------------------------
def test_split_equals_unsplit():
    model, (x,) = mlp(), inputs(1)
    ref, (ref_input_grad,) = reference(model, [x])
    store = WeightGradStore()
    forward_and_b(store, model, x, (0, 0))
    assert len(store) == 2 and store.pending_keys() == [(0, 0)]
    after_b = grads(model)
    assert [after_b[name] for name in weights(model)] == [None, None]
    for name in ("0.bias", "1.bias"):
        assert_matches(after_b[name], ref[name])
    assert_matches(x.grad, ref_input_grad)

    store.run((0, 0))
    for name, grad in grads(model).items():
        assert_matches(grad, ref[name])
    assert len(store) == 0 and not store.alive
    store.check_empty()


def test_microbatches_accumulate_whatever_the_w_order():
    model, xs = mlp(), inputs(3)
    ref, _ = reference(model, xs)
    store = WeightGradStore()
    for mb, x in enumerate(xs):
        forward_and_b(store, model, x, (0, mb))
    assert store.pending_keys() == [(0, 0), (0, 1), (0, 2)]
    store.run((0, 2))
    assert store.pending_keys() == [(0, 0), (0, 1)]
    store.run((0, 0))
    store.run((0, 1))
    for name, grad in grads(model).items():
        assert_matches(grad, ref[name])
    store.check_empty()


def test_check_empty_names_the_missing_w():
    model, (x,) = mlp(), inputs(1)
    store = WeightGradStore()
    forward_and_b(store, model, x, (1, 3))
    with pytest.raises(RuntimeError, match=re.escape("[(1, 3)] (chunk, mb)")):
        store.check_empty()
    store.run((1, 3))
    store.check_empty()


def test_accumulate_grad_hooks_fire_in_w_only():
    """DDP counts gradient arrivals with these hooks: a weight must arrive once, in W."""
    model, (x,) = mlp(), inputs(1)
    counts = collections.Counter()
    accumulators, handles = [], []
    for name, p in model.named_parameters():
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
        accumulators.append(accumulator)  # the node lives only as long as someone holds it
        handles.append(accumulator.register_hook(lambda *_, name=name: counts.update([name])))
    store = WeightGradStore()
    forward_and_b(store, model, x, (0, 0))
    assert counts == {"0.bias": 1, "1.bias": 1}
    store.run((0, 0))
    assert counts == {"0.bias": 1, "1.bias": 1, "0.weight": 1, "1.weight": 1}
    for handle in handles:
        handle.remove()


def test_gradient_accumulation_fusion_adds_into_main_grad():
    model, (x,) = mlp(), inputs(1)
    ref, _ = reference(model, [x])
    for layer in model:
        layer.gradient_accumulation_fusion = True  # the constructor refuses it without the CUDA extension
    for p in weights(model).values():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    model[0].weight.zero_out_wgrad = True
    store = WeightGradStore()
    forward_and_b(store, model, x, (0, 0))
    for p in weights(model).values():
        assert not p.grad_added_to_main_grad and not p.main_grad.any()
    store.run((0, 0))
    for name, p in weights(model).items():
        assert_matches(p.main_grad, ref[name])
        assert p.grad_added_to_main_grad
    assert torch.equal(model[0].weight.grad, torch.zeros_like(model[0].weight))  # megatron's placeholder


def test_anchor_keeps_a_linear_without_grad_inputs_in_the_graph():
    """Neither x nor a bias needs a gradient in the first linear (nor in the row linear, whose bias
    is added outside the linear function): only the anchor makes autograd reach their backward."""
    model, (x,) = mlp(bias=False), inputs(1, requires_grad=False)
    ref, _ = reference(model, [x])
    store = WeightGradStore()
    forward_and_b(store, model, x, (0, 0))
    assert len(store) == 2 and model[0].weight.grad is None
    store.run((0, 0))
    for name, grad in grads(model).items():
        assert_matches(grad, ref[name])


def test_outside_our_passes_megatron_runs_unchanged():
    model, (x,) = mlp(), inputs(1)
    assert megatron_layers.linear_with_grad_accumulation_and_async_allreduce is linear_split.splittable_linear
    out, _ = model[0](x)
    assert type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    loss(model, x).backward()
    assert all(grad is not None for grad in grads(model).values())
    model.zero_grad(set_to_none=True)

    store = WeightGradStore()
    with store.recording():
        out, _ = model[0](x)
    assert type(out.grad_fn).__name__ == "_SplitLinearBackward"


def test_recorded_forward_with_undeferred_backward_computes_w_in_b():
    model, (x,) = mlp(), inputs(1)
    ref, _ = reference(model, [x])
    store = WeightGradStore()
    with store.recording():
        value = loss(model, x)
    value.backward()
    assert len(store) == 0
    for name, grad in grads(model).items():
        assert_matches(grad, ref[name])


# -- Transformer Engine's backward_dw interface, with a CPU stand-in -----------------------------
class _FakeTEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, layer):
        ctx.save_for_backward(input, weight)
        ctx.layer = layer
        return input.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        if ctx.layer.delay_wgrad_compute:
            ctx.layer.pending.append((input, grad_output))
            return grad_output.matmul(weight), None, None
        return grad_output.matmul(weight), _wgrad(input, grad_output), None


def _wgrad(input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    return grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))


class FakeTELinear(torch.nn.Module):
    """TE's delay_wgrad_compute contract: B pushes (input, grad_output), backward_dw() pops the oldest."""

    def __init__(self, in_size: int, out_size: int, delay_wgrad_compute: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_size, in_size) * 0.3)
        self.delay_wgrad_compute = delay_wgrad_compute
        self.pending: collections.deque = collections.deque()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FakeTEFunction.apply(x, self.weight, self)

    def need_backward_dw(self) -> bool:
        return self.delay_wgrad_compute

    def backward_dw(self) -> None:
        if not self.delay_wgrad_compute:
            return
        self.calls += 1
        grad = _wgrad(*self.pending.popleft())
        self.weight.grad = grad if self.weight.grad is None else self.weight.grad + grad


class Chunk(torch.nn.Module):
    """Two delayed TE layers, a megatron linear (split by us) and an undelayed TE layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.te1 = FakeTELinear(HIDDEN, FFN, delay_wgrad_compute=True)
        self.fc = column(FFN, FFN)
        self.te2 = FakeTELinear(FFN, HIDDEN, delay_wgrad_compute=True)
        self.te3 = FakeTELinear(HIDDEN, HIDDEN, delay_wgrad_compute=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc(torch.tanh(self.te1(x)))
        return (self.te3(self.te2(torch.tanh(hidden))) ** 2).sum()


def _run_chunk(chunk: Chunk, x: torch.Tensor) -> torch.Tensor:
    return chunk(x)


def test_te_layers_run_backward_dw_in_w_in_b_order():
    chunk, xs = Chunk(), inputs(2)
    delayed = te_wgrad.delayed_wgrad_layers(chunk)
    assert delayed == [chunk.te1, chunk.te2]  # not te3 (undelayed), not megatron's no-op backward_dw
    for layer in delayed:
        layer.delay_wgrad_compute = False
    refs = [reference(chunk, [x], _run_chunk)[0] for x in xs]
    for layer in delayed:
        layer.delay_wgrad_compute = True

    store = WeightGradStore()
    for mb, x in enumerate(xs):
        forward_and_b(store, chunk, x, (0, mb), _run_chunk, [te_wgrad.BackwardDwJob(delayed)])
    deferred = ["te1.weight", "fc.weight", "te2.weight"]
    assert all(grads(chunk)[name] is None for name in deferred)
    assert chunk.te3.weight.grad is not None and (chunk.te1.calls, chunk.te2.calls) == (0, 0)

    with pytest.raises(RuntimeError, match="B order"):
        store.run((0, 1))
    store.run((0, 0))
    assert (chunk.te1.calls, chunk.te2.calls) == (1, 1)
    for name in deferred:
        assert_matches(grads(chunk)[name], refs[0][name])
    store.run((0, 1))
    assert (chunk.te1.calls, chunk.te2.calls) == (2, 2)
    for name, grad in grads(chunk).items():
        assert_matches(grad, refs[0][name] + refs[1][name])
    store.check_empty()
