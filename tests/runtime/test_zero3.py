"""ZeRO-3 through PyTorch FSDP2, driven by hand-written UNSHARD / RESHARD / REDUCE_GRAD orders.

Two gloo ranks (dp=2, pp=1) run a small GPTModel cut into two chunks on the same rank, with
B/W split (W from our queue, after the chunk's weights were released) and the data-parallel
actions where a breadth-first plan puts them. Gradients, and parameters after each step of
megatron-core's optimizer, equal an unsharded single-process reference that runs both
ranks' microbatches, and FSDP2 issues exactly the planned collectives. Four ranks (pp=2 x
dp=2) run the existing runtime with the backend called from megatron-core's sync hooks.
Orders are written like the IR: ``U0`` UNSHARD chunk 0, ``R0`` RESHARD, ``G0`` REDUCE_GRAD,
``F1.2`` F of chunk 1 microbatch 2, ``B``, ``W``.
"""

from __future__ import annotations

import collections
import contextlib
import time

import pytest
import torch

TOLERANCE = 1e-5
M = 4
LR = 1e-2
MOMENTUM = 0.9
CLIP = 0.5  # below the toy's gradient norm: clipping needs the global norm over every shard and stage
DELAY_S = 1.0

# Breadth-first on one rank: every microbatch through chunk 0, then chunk 1; chunk 0 released
# between its forward and backward windows and gathered again (prefetched during chunk 1's Bs);
# Ws after the release; one reduction per chunk after its last W.
BREADTH_FIRST = (
    "U0 F0.0 U1 F0.1 F0.2 F0.3 R0 F1.0 F1.1 F1.2 F1.3 B1.3 U0 B1.2 W1.3 B1.1 B1.0 R1 W1.2 "
    "B0.3 W1.1 B0.2 B0.1 W1.0 G1 B0.0 R0 W0.3 W0.2 W0.1 W0.0 G0"
)
# Two depth-first groups of two microbatches: each chunk reduced after each group (FSDP2 adds them up).
DEPTH_FIRST_GROUPS = (
    "U0 U1 F0.0 F0.1 F1.0 F1.1 B1.1 B1.0 W1.1 W1.0 G1 B0.1 B0.0 W0.1 W0.0 G0 "
    "F0.2 F0.3 F1.2 F1.3 B1.3 B1.2 W1.3 W1.2 G1 B0.3 B0.2 R1 W0.3 W0.2 G0 R0"
)
SCRIPTS = {"breadth-first": BREADTH_FIRST, "depth-first-groups": DEPTH_FIRST_GROUPS}


@pytest.fixture(scope="module")
def pool(worker_pools):
    return worker_pools.get(2)


@pytest.fixture(scope="module")
def pool4(worker_pools):
    return worker_pools.get(4)


# -- what runs on every rank ----------------------------------------------------------------------
def _setup(pp: int = 1, layers: int = 2):
    from megatron.core import parallel_state

    from megatron_zb.runtime import linear_split
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=pp)
    linear_split.install()
    toy = ToyGPT(layers=layers)
    return toy, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def _optimizer_config():
    """SGD with momentum (state in the shards), clipped by the global norm.

    Not Adam: its first step is about lr * sign(g) per element, so an element whose gradient
    is near zero (a layernorm bias) turns a rounding difference of the summation order into
    a visible difference of the parameter; SGD keeps the comparison as tight as the gradients'.
    """
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="sgd", lr=LR, sgd_momentum=MOMENTUM, weight_decay=0.0, clip_grad=CLIP, params_dtype=torch.float32
    )


def _reference_optimizer(blocks: list):
    return torch.optim.SGD([p for block in blocks for p in block.parameters()], lr=LR, momentum=MOMENTUM)


def _reference_step(blocks: list, batches: list, m: int):
    """The unsharded reference: all ranks' microbatches, gradients clipped by the global norm (as megatron-core)."""
    from megatron_zb.testing.toy_gpt import reference_step

    for block in blocks:
        block.zero_grad(set_to_none=True)
    reference_step(blocks, batches, num_microbatches=m)
    grads = [{name: p.grad.clone() for name, p in block.named_parameters()} for block in blocks]
    norm = torch.nn.utils.clip_grad_norm_([p for block in blocks for p in block.parameters()], CLIP)
    assert norm > CLIP, f"gradient norm {float(norm):.3f} is below the clipping threshold: clipping untested"
    return grads


def _worst(chunks: list, references: list[dict], of: str) -> tuple[float, int]:
    """Worst relative difference of the full (gathered) gradients or parameters against the reference."""
    from megatron_zb.testing.parallel import unwrapped

    worst, compared = 0.0, 0
    for chunk, reference in zip(chunks, references, strict=True):
        for name, param in unwrapped(chunk).named_parameters():
            mine = (param.grad if of == "grad" else param.detach()).full_tensor()
            theirs = reference[name]
            scale = theirs.abs().max().clamp(min=1e-30)
            worst = max(worst, float((mine - theirs).abs().max() / scale))
            compared += 1
    return worst, compared


@contextlib.contextmanager
def _counting_collectives():
    """Count the all-gathers and reduce-scatters issued inside (FSDP2 calls the ``*_single`` forms where they exist)."""
    import torch.distributed as dist

    counts = collections.Counter()
    originals = {}
    for kind, names in (
        ("all_gather", ("all_gather_single", "all_gather_into_tensor")),
        ("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor")),
    ):
        name = next(n for n in names if hasattr(dist, n))
        originals[name] = getattr(dist, name)

        def counted(*args, _kind=kind, _original=originals[name], **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


class _Interpreter:
    """Runs an order of U/R/G/F/B/W tokens on this rank's chunks (chunk c+1 consumes chunk c's output)."""

    def __init__(self, backend, ctx, store, config):
        self.backend, self.ctx, self.store, self.config = backend, ctx, store, config
        self.stash, self.inbox = {}, {}
        self.observed = []

    def run(self, order: str) -> None:
        for token in order.split():
            getattr(self, "_" + token[0])(token)
            self.observed.append(self._observe(token))

    def _observe(self, token: str) -> dict:
        backend, chunks = self.backend, range(len(self.ctx.models))
        return {
            "token": token,
            "state": [backend.state(c) for c in chunks],
            "gathered": [backend.gathered_bytes(c) for c in chunks],
            "unreduced": [backend.unreduced_grad_bytes(c) for c in chunks],
        }

    def _U(self, token):
        self.backend.unshard(int(token[1:]))

    def _R(self, token):
        self.backend.reshard(int(token[1:]))

    def _G(self, token):
        self.backend.reduce_grad(int(token[1:]))

    def _F(self, token):
        from megatron_zb.runtime import steps

        chunk, mb = map(int, token[1:].split("."))
        last = chunk == len(self.ctx.models) - 1
        self.backend.wait_unsharded(chunk, token)
        input_tensor = self.inbox.pop(("activation", chunk, mb)) if chunk > 0 else None
        with self.store.recording():
            output = steps.forward(self.ctx, chunk, mb, input_tensor, last, mb == 0)
        if not last:
            self.inbox["activation", chunk + 1, mb] = output.detach().requires_grad_()
        self.stash[chunk, mb] = (input_tensor, output)

    def _B(self, token):
        from megatron_zb.runtime import steps

        chunk, mb = map(int, token[1:].split("."))
        self.backend.wait_unsharded(chunk, token)
        input_tensor, output = self.stash.pop((chunk, mb))
        last = chunk == len(self.ctx.models) - 1
        output_grad = None if last else self.inbox.pop(("gradient", chunk, mb))
        with self.store.deferring((chunk, mb)):
            input_grad = steps.backward(output, output_grad, input_tensor, self.config)
        if chunk > 0:
            self.inbox["gradient", chunk - 1, mb] = input_grad

    def _W(self, token):
        chunk, mb = map(int, token[1:].split("."))
        self.store.run((chunk, mb))


def run_order(order: str, iterations: int = 2) -> dict:
    """Two iterations of ``order`` with an optimizer step between: gradients and parameters against the reference."""

    from megatron_zb.runtime import steps
    from megatron_zb.runtime.dp import FSDP2Backend, wrap_zero3, zero3_optimizer
    from megatron_zb.runtime.wgrad import WeightGradStore
    from megatron_zb.testing.toy_gpt import forward_step

    toy, dp_rank, dp_size = _setup()
    config = toy.config(1, 1)
    chunks = wrap_zero3(config, [toy.block(config, block, 2) for block in range(2)])
    optimizer = zero3_optimizer(_optimizer_config(), chunks)
    blocks = [toy.block(config, block, 2) for block in range(2)]
    reference_optimizer = _reference_optimizer(blocks)
    batches = toy.batches(M, stream=dp_rank)
    everyone = [batch for stream in range(dp_size) for batch in toy.batches(M, stream=stream)]
    result = {"grads": [], "params": [], "observed": None, "counts": None, "queued": 0}
    for _ in range(iterations):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        backend = FSDP2Backend(chunks)
        store = WeightGradStore()
        ctx = steps.ForwardContext(forward_step, [iter(batches) for _ in chunks], chunks, M, config)
        interpreter = _Interpreter(backend, ctx, store, config)
        with _counting_collectives() as collectives:
            interpreter.run(order)
            backend.finish()
        store.check_empty()
        reference = _reference_step(blocks, everyone, M * dp_size)
        result["grads"].append(_worst(chunks, reference, "grad"))
        optimizer.step()
        reference_optimizer.step()
        state = [{name: p.detach() for name, p in block.named_parameters()} for block in blocks]
        result["params"].append(_worst(chunks, state, "param"))
        result["observed"] = interpreter.observed
        result["counts"] = dict(backend.counts())
        result["collectives"] = dict(collectives)
        result["queued"] = store.queued
    result["full_bytes"] = [sum(p.numel() * 4 for p in block.parameters()) for block in blocks]
    return result


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_hand_written_order_matches_unsharded_reference(pool, name):
    order = SCRIPTS[name]
    results = pool.run(run_order, order=order)
    for rank, result in enumerate(results):
        for iteration, (worst, compared) in enumerate(result["grads"]):
            assert compared > 20, f"rank {rank}: compared only {compared} gradients"
            assert worst <= TOLERANCE, f"rank {rank} iteration {iteration}: gradient differs by {worst:.2e}"
        for iteration, (worst, _) in enumerate(result["params"]):
            assert worst <= TOLERANCE, f"rank {rank} after step {iteration + 1}: parameter differs by {worst:.2e}"
        assert result["queued"] >= 2 * M, "B deferred no weight gradients: W was not split off"
        tokens = order.split()
        expected = {(kind, chunk): 0 for kind in ("UNSHARD", "RESHARD", "REDUCE_GRAD") for chunk in (0, 1)}
        for token in tokens:
            if token[0] in "URG":
                kind = {"U": "UNSHARD", "R": "RESHARD", "G": "REDUCE_GRAD"}[token[0]]
                expected[kind, int(token[1:])] += 1
        assert result["counts"] == {key: n for key, n in expected.items() if n}
        # One all-gather per UNSHARD, one reduce-scatter per REDUCE_GRAD, none from FSDP2's own hooks
        # (left on, they would reduce after every B: the same sum, m times the communication).
        gathers = sum(n for (kind, _), n in expected.items() if kind == "UNSHARD")
        reductions = sum(n for (kind, _), n in expected.items() if kind == "REDUCE_GRAD")
        assert result["collectives"] == {"all_gather": gathers, "reduce_scatter": reductions}
        _check_memory_states(result["observed"], result["full_bytes"], tokens)


def _check_memory_states(observed: list[dict], full_bytes: list[int], tokens: list[str]) -> None:
    """Gathered weights take their full size until RESHARD frees them; gradients survive it until REDUCE_GRAD."""
    assert [o["token"] for o in observed] == tokens
    for seen in observed:
        token = seen["token"]
        for chunk, state in enumerate(seen["state"]):
            expected = full_bytes[chunk] if state == "gathered" else 0
            if state != "gathering":
                assert seen["gathered"][chunk] == expected, f"after {token}: chunk {chunk} holds {seen['gathered']}"
        if token[0] == "R":
            assert seen["state"][int(token[1:])] == "sharded"
        if token[0] == "G":
            assert seen["unreduced"][int(token[1:])] == 0, f"after {token}: gradients left unreduced"


def test_prefetch_in_flight_until_first_use_and_gradients_outlive_release(pool):
    """U1 is issued during chunk 0's forwards and stays 'gathering' until F1.0 waits on it; R1 and the
    second R0 release weights while the chunk's gradients still wait for W and REDUCE_GRAD."""
    (result, _) = pool.run(run_order, order=BREADTH_FIRST, iterations=1)
    released = [
        (o["token"], o["unreduced"][int(o["token"][1:])] > 0) for o in result["observed"] if o["token"][0] == "R"
    ]
    assert released == [("R0", False), ("R1", True), ("R0", True)]
    states = {}
    for seen in result["observed"]:
        states.setdefault(seen["token"], seen["state"][1])  # the first occurrence of each token
    assert [states[t] for t in ("U1", "F0.1", "F0.3", "R0")] == ["gathering"] * 4
    assert states["F1.0"] == "gathered"


def run_late_peer(delay_s: float) -> dict:
    """Rank 1 joins the gather ``delay_s`` late: rank 0's unshard returns at once, its wait takes the delay."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from megatron_zb.runtime.dp import FSDP2Backend, wrap_zero3

    toy, _, _ = _setup()
    config = toy.config(1, 1)
    (chunk,) = wrap_zero3(config, [toy.block(config, 0, 1)])
    backend = FSDP2Backend([chunk])
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(delay_s)
    started = time.perf_counter()
    backend.unshard(0)
    issued_s = time.perf_counter() - started
    state = backend.state(0)
    still_sharded = all(isinstance(p, DTensor) for p in chunk.module.parameters())
    started = time.perf_counter()
    backend.wait_unsharded(0, "the test")
    waited_s = time.perf_counter() - started
    gathered = backend.gathered_bytes(0)
    plain = not any(isinstance(p, DTensor) for p in chunk.module.parameters())
    backend.reshard(0)
    backend.finish()
    return {
        "issued_s": issued_s,
        "waited_s": waited_s,
        "state": state,
        "still_sharded": still_sharded,
        "gathered": gathered,
        "plain_after_wait": plain,
        "freed": backend.gathered_bytes(0),
        "full_bytes": sum(p.numel() * 4 for p in toy.block(config, 0, 1).parameters()),
    }


def test_unshard_is_asynchronous_and_reshard_frees(pool):
    results = pool.run(run_late_peer, delay_s=DELAY_S)
    early = results[0]
    assert early["issued_s"] < DELAY_S / 2, f"unshard blocked for {early['issued_s']:.2f} s"
    assert early["waited_s"] > DELAY_S / 2, f"the wait took only {early['waited_s']:.2f} s"
    for result in results:
        assert result["state"] == "gathering" and result["still_sharded"]
        assert result["plain_after_wait"] and result["gathered"] == result["full_bytes"]
        assert result["freed"] == 0


BROKEN_ORDERS = {
    "F0.0 U0": "F0.0 computes on chunk 0 while its weights are sharded",
    "U0 U0": "UNSHARD of chunk 0 while its weights are already gathering",
    "U0 R0": "RESHARD of chunk 0 right after its UNSHARD",
    "R0": "RESHARD of chunk 0, whose weights are not gathered",
    "U0 F0.0": "chunk 0's weights are still gathered at the end of the iteration",
    "U0 F0.0 B0.0 R0 W0.0": "chunk 0 holds gradients that no REDUCE_GRAD reduced",
}


def run_broken(order: str) -> str:
    """The refusal a broken order meets (in the backend's words), or '' when it ran."""
    from megatron_zb.runtime import steps
    from megatron_zb.runtime.dp import DataParallelPlanError, FSDP2Backend, wrap_zero3
    from megatron_zb.runtime.wgrad import WeightGradStore
    from megatron_zb.testing.toy_gpt import forward_step

    toy, dp_rank, _ = _setup()
    config = toy.config(1, 1)
    chunks = wrap_zero3(config, [toy.block(config, 0, 1)])
    backend = FSDP2Backend(chunks)
    ctx = steps.ForwardContext(forward_step, [iter(toy.batches(1, stream=dp_rank))], chunks, 1, config)
    try:
        _Interpreter(backend, ctx, WeightGradStore(), config).run(order)
        backend.finish()
    except DataParallelPlanError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("order", sorted(BROKEN_ORDERS))
def test_broken_orders_are_refused_by_name(pool, order):
    for message in pool.run(run_broken, order=order):
        assert BROKEN_ORDERS[order] in message, message


def run_refusals() -> list[str]:
    from megatron_zb.runtime.dp import backend_for, wrap_zero3, zero3_optimizer

    toy, _, _ = _setup()
    messages = []
    for field in ("gradient_accumulation_fusion", "calculate_per_token_loss"):
        config = toy.config(1, 1)
        setattr(config, field, True)
        try:
            wrap_zero3(config, [toy.block(toy.config(1, 1), 0, 1)])
        except ValueError as error:
            messages.append(str(error))
    config = toy.config(1, 1)
    optimizer_config = _optimizer_config()
    optimizer_config.use_distributed_optimizer = True
    sharded = wrap_zero3(config, [toy.block(config, 0, 1)])
    try:
        zero3_optimizer(optimizer_config, sharded)
    except ValueError as error:
        messages.append(str(error))
    try:
        backend_for(config, [*sharded, toy.block(config, 0, 1)])
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_unsupported_settings_are_refused(pool):
    messages = pool.run(run_refusals)[0]
    assert len(messages) == 4
    assert "ZeRO-3 (FSDP2) does not support gradient_accumulation_fusion" in messages[0]
    assert "ZeRO-3 (FSDP2) does not support calculate_per_token_loss" in messages[1]
    assert "turn use_distributed_optimizer off" in messages[2]
    assert "model chunks [0] are sharded with FSDP2 (ZeRO-3) and the others are not" in messages[3]


# -- pp=2 x dp=2 through the existing runtime ------------------------------------------------------
def run_pipelined(name: str, m: int, chunks: int | None) -> dict:
    """Our runtime on FSDP2 chunks: the executor runs the schedule lowered with ZeRO-3's windows."""
    from collections import Counter

    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.dp import wrap_zero3, zero3_optimizer
    from megatron_zb.schedule.lower import DataParallel, lower

    toy, dp_rank, dp_size = _setup(pp=2, layers=8)
    runner = ForwardBackward(name, timeout_s=60, chunks=chunks)
    schedule = runner.schedule_for(2, m)
    config = toy.config(2, schedule.chunks)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    model = wrap_zero3(config, toy.chunks(config, schedule, rank))
    optimizer = zero3_optimizer(_optimizer_config(), model)
    config.finalize_model_grads_func = finalize_model_grads
    with _counting_collectives() as collectives:
        losses = toy.step(runner, model, toy.batches(m, stream=dp_rank))
    blocks = toy.all_blocks(config, schedule.placement)
    block_of = {chunk: block for block, (owner, chunk) in enumerate(schedule.placement.blocks) if owner == rank}
    everyone = [batch for stream in range(dp_size) for batch in toy.batches(m, stream=stream)]
    reference = _reference_step(blocks, everyone, m * dp_size)
    grads = _worst(model, [reference[block_of[c]] for c in range(len(model))], "grad")
    optimizer.step()
    _reference_optimizer(blocks).step()
    stepped = [{n: p.detach() for n, p in blocks[block_of[c]].named_parameters()} for c in range(len(model))]
    planned = lower(schedule, DataParallel(gather="windows"))
    expected = Counter((p.kind.value, schedule.chunk_of(p)) for p in planned.orders[rank] if not p.kind.is_compute)
    return {
        "losses": len(losses),
        "grads": grads,
        "params": _worst(model, stepped, "param"),
        "counts": dict(runner.last_backend.counts()),
        "expected": dict(expected),
        "collectives": dict(collectives),
        "queued": runner.last_store.queued,
    }


@pytest.mark.parametrize("name,m,chunks", [("zb-h1", 4, None), ("zb-1p", 5, 2)])
def test_pipeline_and_zero3_match_reference(pool4, name, m, chunks):
    results = pool4.run(run_pipelined, name=name, m=m, chunks=chunks)
    assert sorted(r["losses"] for r in results) == [0, 0, m, m], "one loss rank per pipeline"
    for rank, result in enumerate(results):
        worst, compared = result["grads"]
        assert compared > 0 and worst <= TOLERANCE, f"rank {rank}: gradient differs by {worst:.2e}"
        assert result["params"][0] <= TOLERANCE, f"rank {rank}: parameter differs by {result['params'][0]:.2e}"
        assert result["queued"] >= m, "W was not split off"
        counts = result["counts"]
        assert counts == result["expected"], "the backend ran exactly the planned actions"
        assert all(counts["REDUCE_GRAD", c] == 1 for c in range(chunks or 1))
        gathers = sum(count for (kind, _), count in counts.items() if kind == "UNSHARD")
        assert result["collectives"] == {"all_gather": gathers, "reduce_scatter": chunks or 1}


# -- megatron-core DDP (ZeRO-1/2) behind the same interface: which hooks each action calls ----------
class _Chunk(torch.nn.Linear):
    def __init__(self, overlap: bool):
        super().__init__(2, 2)
        self.ddp_config = type("DDPConfig", (), {"overlap_grad_reduce": overlap})()
        self.grad_syncs = 0

    def start_grad_sync(self):
        self.grad_syncs += 1


def test_megatron_ddp_backend_calls_megatron_hooks_once_per_iteration():
    from types import SimpleNamespace

    from megatron_zb.runtime.dp import DataParallelPlanError, MegatronDDPBackend, backend_for

    calls = []
    chunks = [_Chunk(True), _Chunk(True)]
    config = SimpleNamespace(
        param_sync_func=[lambda params, c=c: calls.append(("param", c, len(list(params)))) for c in range(2)],
        grad_sync_func=[lambda params, c=c: calls.append(("grad", c, len(list(params)))) for c in range(2)],
    )
    backend = backend_for(config, chunks)
    assert isinstance(backend, MegatronDDPBackend)
    for _ in range(2):  # two iterations: the parameter all-gather runs once per chunk in each
        for chunk in (0, 1, 0):  # chunk 0 gathered again for a backward window
            backend.unshard(chunk).wait()
            backend.wait_unsharded(chunk)
            backend.reshard(chunk)
        backend.reduce_grad(1)
        backend.reduce_grad(0)
        with pytest.raises(DataParallelPlanError, match="REDUCE_GRAD of chunk 0 twice in one iteration"):
            backend.reduce_grad(0)
        backend.finish()
    once = [("param", 0, 2), ("param", 1, 2), ("grad", 1, 2), ("grad", 0, 2)]
    assert calls == once + once
    assert [chunk.grad_syncs for chunk in chunks] == [0, 0], "grad_sync_func set: megatron-core's hook, not DDP's"
    # evaluation (forward only) gathers nothing, as megatron-core's schedules: Megatron-LM's evaluate() turns the
    # pre-hooks that would wait for a gather off, and a gather left pending failed the next one (test-set eval)
    calls.clear()
    evaluation = backend_for(config, chunks, forward_only=True)
    for chunk in (0, 1):
        evaluation.unshard(chunk).wait()
    evaluation.finish()
    assert calls == []


@pytest.mark.parametrize("overlap", [True, False])
def test_megatron_ddp_backend_without_hooks_starts_ddp_reduction_only_with_overlap(overlap):
    from types import SimpleNamespace

    from megatron_zb.runtime.dp import MegatronDDPBackend

    chunks = [_Chunk(overlap)]
    backend = MegatronDDPBackend(SimpleNamespace(param_sync_func=None, grad_sync_func=None), chunks)
    backend.unshard(0)
    backend.reduce_grad(0)
    backend.finish()
    assert chunks[0].grad_syncs == (1 if overlap else 0)
