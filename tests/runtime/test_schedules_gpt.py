"""Every registered schedule on a megatron-core GPTModel equals the unpipelined reference.

Four gloo processes run all cases (pp=2 runs as two identical pipelines). The reference is
the same layer blocks, built with the same seeds, chained in one process. Llama-style layers
(ToyGPT(llama=True)) run one schedule of each family at pp=2 and pp=4, to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from megatron_zb.schedule import PassKind, ScheduleError, ScheduleSpec, build, names
from megatron_zb.testing.pool import WorkerPool

TOLERANCE = 1e-5
# Refusals the grid is expected to meet, with a word their message must contain.
# (schedule, a word of its refusal) for settings it cannot run
EXPECTED_REFUSALS: set[tuple[str, str]] = {("bitpipe", "divisible by pp"), ("bitpipe-zb", "divisible by pp")}


@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def run_case(
    name: str, pp: int, m: int, forward_only: bool = False, chunks: int | None = None, llama: bool = False
) -> dict:
    """On every rank: our run and the reference chain; what the test compares."""
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.parallel import compare_to_blocks, init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT, forward_step, reference_step

    init_parallel(pp=pp)
    toy = ToyGPT(llama=llama)
    runner = ForwardBackward(name, timeout_s=60, chunks=chunks, layers=toy.layers)  # auto: chunks that split them
    schedule = runner.schedule_for(pp, m)
    config = toy.config(pp, schedule.chunks)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = toy.chunks(config, schedule, rank)
    batches = toy.batches(m)
    iterators = [iter(batches) for _ in chunks]
    with torch.no_grad() if forward_only else torch.enable_grad():
        losses = runner(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=m,
            seq_length=toy.seq,
            micro_batch_size=toy.micro_batch,
            forward_only=forward_only,
        )
    blocks = toy.all_blocks(config, schedule.placement)
    with torch.no_grad() if forward_only else torch.enable_grad():
        reference = reference_step(blocks, batches) if not forward_only else _forward_losses(blocks, batches)
    worst, compared = (0.0, 0) if forward_only else compare_to_blocks(chunks, blocks, schedule, rank)
    loss_pipes = [
        pipe
        for pipe, placement in enumerate(schedule.placements)
        if placement.rank_of(placement.num_stages - 1) == rank
    ]
    return {
        "losses": [float(d["lm loss"][0]) for d in losses],
        # which microbatches this rank's losses are: its pipes' (several pipes carry disjoint microbatches)
        "microbatches": sorted({p.microbatch for order in schedule.orders for p in order if p.pipe in loss_pipes}),
        "reference": reference,
        "worst_grad": worst,
        "compared": compared,
        "queued_w": runner.last_store.queued,
        "splits_w": any(p.kind is PassKind.W for order in schedule.orders for p in order),
    }


def _forward_losses(blocks, batches) -> list[float]:
    from megatron_zb.testing.toy_gpt import loss_func

    losses = []
    for batch in batches:
        hidden = None
        for model in blocks:
            model.set_input_tensor(hidden)
            hidden = model(
                batch["tokens"] if model.pre_process else None,
                batch["position_ids"] if model.pre_process else None,
                None,
                labels=batch["labels"] if model.post_process else None,
            )
        losses.append(float(loss_func(batch["loss_mask"], hidden)[0]))
    return losses


def check(results: list[dict], pp: int, m: int, forward_only: bool = False, tolerance: float = TOLERANCE) -> None:
    loss_ranks = [r for r in results if r["losses"]]
    covered = sorted(mb for r in loss_ranks for mb in r["microbatches"])
    assert covered == sorted(list(range(m)) * (len(results) // pp)), "each microbatch's loss comes back from one rank"
    for result in loss_ranks:
        assert len(result["losses"]) == len(result["microbatches"])
        theirs = [result["reference"][mb] for mb in result["microbatches"]]
        worst_loss = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], theirs, strict=True))
        assert worst_loss <= tolerance, f"loss differs by {worst_loss:.2e}"
    if not forward_only:
        for rank, result in enumerate(results):
            assert result["compared"] > 0, f"rank {rank} compared no gradients"
            assert result["worst_grad"] <= tolerance, f"rank {rank}: gradient differs by {result['worst_grad']:.2e}"


# every schedule at pp=2 with m = pp and an odd m, and at pp=4 in its steady state (m = 2pp)
GRID = [(name, pp, m) for pp, m in ((2, 2), (2, 5), (4, 8)) for name in names()]


@pytest.mark.parametrize("name,pp,m", GRID, ids=[f"{n}-pp{p}-m{m}" for n, p, m in GRID])
def test_schedule_matches_unpipelined_reference(pool, name, pp, m):
    try:
        schedule = build(name, ScheduleSpec(pp, m))
    except ScheduleError as error:
        expected = [word for refused, word in EXPECTED_REFUSALS if refused == name]
        assert expected and expected[0] in str(error), f"unexpected refusal: {error}"
        return
    results = pool.run(run_case, name=name, pp=pp, m=m)
    check(results, pp, m)
    # Split backwards queue every linear's weight gradient for W; fused BW passes run
    # megatron-core's own linears, which queue nothing.
    if any(p.kind is PassKind.W for order in schedule.orders for p in order):
        assert all(r["queued_w"] >= m for r in results)
    else:
        assert all(r["queued_w"] == 0 for r in results)


INTERLEAVED_ZB = [("zb-1p", 2, 5, 2), ("zb-2p", 4, 8, 2), ("zb-auto", 2, 4, 4)]


@pytest.mark.parametrize("name,pp,m,chunks", INTERLEAVED_ZB)
def test_zero_bubble_on_the_looping_placement_matches_reference(pool, name, pp, m, chunks):
    """--chunks v >= 2 plans zero bubble on Megatron's interleaved placement: B and W split, same math."""
    results = pool.run(run_case, name=name, pp=pp, m=m, chunks=chunks)
    check(results, pp, m)
    assert all(r["queued_w"] >= m * chunks for r in results)


FORWARD_ONLY = [("zb-h1", 2, 5), ("interleaved-1f1b", 4, 8), ("zb-v", 4, 9), ("v-min", 2, 3)]


@pytest.mark.parametrize("name,pp,m", FORWARD_ONLY)
def test_forward_only_matches_reference(pool, name, pp, m):
    results = pool.run(run_case, name=name, pp=pp, m=m, forward_only=True)
    check(results, pp, m, forward_only=True)
    assert all(r["queued_w"] == 0 for r in results)


def run_against_megatron(pp: int, m: int, name: str = "1f1b", llama: bool = False) -> dict:
    """megatron-core's own 1F1B, then our ``name`` (one chunk per rank), on the same chunk: losses and gradients."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT, forward_step

    init_parallel(pp=pp)
    toy = ToyGPT(llama=llama)
    runner = ForwardBackward(name, timeout_s=60)
    schedule = runner.schedule_for(pp, m)
    (chunk,) = toy.chunks(toy.config(pp, 1), schedule, parallel_state.get_pipeline_model_parallel_rank())
    batches = toy.batches(m)
    outcome = {}
    for label, function in (("megatron", forward_backward_pipelining_without_interleaving), ("ours", runner)):
        chunk.zero_grad(set_to_none=True)
        losses = function(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[chunk],
            num_microbatches=m,
            seq_length=toy.seq,
            micro_batch_size=toy.micro_batch,
        )
        outcome[label] = {
            "losses": [float(d["lm loss"][0]) for d in losses],
            "grads": {key: p.grad.clone() for key, p in chunk.named_parameters()},
        }
    outcome["ours"]["queued_w"] = runner.last_store.queued
    outcome["ours"]["linears"] = sum(
        isinstance(module, (ColumnParallelLinear, RowParallelLinear)) for module in chunk.modules()
    )
    return outcome


def run_against_megatron_interleaved(name: str, pp: int, m: int, chunks: int) -> dict:
    """megatron-core's interleaved 1F1B, then our schedule on the same chunks: losses and gradients of both."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT, forward_step

    init_parallel(pp=pp)
    toy = ToyGPT()
    runner = ForwardBackward(name, timeout_s=60, chunks=chunks)
    schedule = runner.schedule_for(pp, m)
    config = toy.config(pp, chunks)
    model = toy.chunks(config, schedule, parallel_state.get_pipeline_model_parallel_rank())
    batches = toy.batches(m)
    outcome = {}
    for label, function in (("megatron", forward_backward_pipelining_with_interleaving), ("ours", runner)):
        for chunk in model:
            chunk.zero_grad(set_to_none=True)
        losses = function(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in model],
            model=model,
            num_microbatches=m,
            seq_length=toy.seq,
            micro_batch_size=toy.micro_batch,
        )
        outcome[label] = {
            "losses": [float(d["lm loss"][0]) for d in losses],
            "grads": {f"{c}.{n}": p.grad.clone() for c, chunk in enumerate(model) for n, p in chunk.named_parameters()},
        }
    return outcome


LOOPING = [("zb-1p", 4, 8), ("zb-2p", 4, 12), ("interleaved-1f1b", 4, 8), ("breadth-first", 4, 8)]
LOOPING += [("breadth-first-zb", 4, 8)]


@pytest.mark.parametrize("name,pp,m", LOOPING)
def test_interleaved_zero_bubble_equals_megatron_core_interleaved(pool, name, pp, m):
    """pp=4 only: at pp=2 (previous and next rank the same peer) megatron-core's interleaved schedule on gloo
    gives gradients that differ from ours and from the unpipelined reference, which ours match there."""
    for outcome in pool.run(run_against_megatron_interleaved, name=name, pp=pp, m=m, chunks=2):
        theirs, ours = outcome["megatron"], outcome["ours"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=TOLERANCE)
        assert ours["grads"].keys() == theirs["grads"].keys()
        for name_, grad in ours["grads"].items():
            torch.testing.assert_close(grad, theirs["grads"][name_], rtol=TOLERANCE, atol=TOLERANCE * 1e-3, msg=name_)


@pytest.mark.parametrize("pp,m", [(2, 5), (4, 8)])
def test_1f1b_equals_megatron_core_1f1b(pool, pp, m):
    for outcome in pool.run(run_against_megatron, pp=pp, m=m):
        theirs, ours = outcome["megatron"], outcome["ours"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=TOLERANCE)
        assert ours["grads"].keys() == theirs["grads"].keys()
        for name, grad in ours["grads"].items():
            torch.testing.assert_close(grad, theirs["grads"][name], rtol=TOLERANCE, atol=TOLERANCE * 1e-3, msg=name)


# The Llama family (ToyGPT(llama=True): SwiGLU, RMSNorm, 4:1 grouped-query attention with explicit head channels,
# no biases, untied embeddings, RoPE with Llama 3 scaling, q/k normalisation): each schedule family at pp=2 and pp=4.
# zb-1p is held to megatron-core's own 1F1B bit for bit below; the rest to the unpipelined reference.
LLAMA_TOLERANCE = 1e-6
LLAMA_FAMILIES = [("1f1b", None), ("zb-2p", None), ("zb-1p", 2), ("zb-v", None), ("v-half", None), ("v-min", None)]
LLAMA_FAMILIES += [("bitpipe", None), ("breadth-first", None)]
LLAMA = [(name, pp, chunks) for pp in (2, 4) for name, chunks in LLAMA_FAMILIES]


@pytest.mark.parametrize(
    "name,pp,chunks", LLAMA, ids=[f"{n}{'-chunks' + str(c) if c else ''}-pp{p}" for n, p, c in LLAMA]
)
def test_llama_layers_match_the_unpipelined_reference(pool, name, pp, chunks):
    m = 2 * pp
    results = pool.run(run_case, name=name, pp=pp, m=m, chunks=chunks, llama=True)
    check(results, pp, m, tolerance=LLAMA_TOLERANCE)
    for result in results:  # split backwards queue the W of every linear (GLU fc1, q/k/v, untied output layer)
        assert result["queued_w"] >= m if result["splits_w"] else result["queued_w"] == 0


@pytest.mark.parametrize("pp", [2, 4])
def test_llama_zb_1p_equals_megatron_core_1f1b_bit_for_bit(pool, pp):
    m = 2 * pp
    for outcome in pool.run(run_against_megatron, pp=pp, m=m, name="zb-1p", llama=True):
        theirs, ours = outcome["megatron"], outcome["ours"]
        # every Column/RowParallelLinear (q/k/v, proj, the GLU fc1, fc2, the untied output layer) deferred its W
        assert ours["queued_w"] == m * ours["linears"] > 0
        assert ours["losses"] == theirs["losses"]
        assert ours["grads"].keys() == theirs["grads"].keys()
        different = [name for name, grad in ours["grads"].items() if not torch.equal(grad, theirs["grads"][name])]
        assert not different, f"gradients not bit-identical to megatron-core's 1F1B: {different}"


def run_profiled(name: str, pp: int = 2, m: int = 6) -> dict:
    """Profile two iterations; return the cost model and this rank's measured work and wall time."""
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    init_parallel(pp=pp)
    profiler = PassProfiler()
    runner = ForwardBackward(name, timeout_s=60, profiler=profiler)
    schedule = runner.schedule_for(pp, m)
    toy = ToyGPT()
    chunks = toy.chunks(toy.config(pp, schedule.chunks), schedule, parallel_state.get_pipeline_model_parallel_rank())
    batches = toy.batches(m)
    profiler.start()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(2):
        toy.step(runner, chunks, batches)
        profiler.next_iteration()
    wall = time.perf_counter() - start
    profiler.stop()
    group = parallel_state.get_pipeline_model_parallel_group()
    costs = profiler.cost_model(schedule, group, (toy.seq, toy.micro_batch, toy.hidden))
    return {
        "costs": costs,
        "passes": sum(1 for r in profiler.records if r.pass_.kind.is_compute),  # actions are recorded too
        "expected_passes": 2 * len(schedule.orders[parallel_state.get_pipeline_model_parallel_rank()]),
        "work": sum(r.end - r.start for r in profiler.records if r.pass_.kind.is_compute),
        "wall": wall,
        "iterations": sorted({r.iteration for r in profiler.records}),
    }


@pytest.mark.parametrize("name", ["zb-h1", "1f1b", "zb-v"])
def test_profiler_measures_every_pass_in_simulator_units(pool, name):
    results = pool.run(run_profiled, name=name)
    costs = results[0]["costs"]
    assert all(r["costs"] == costs for r in results), "every rank gets the same cost model"
    assert costs.pp == 2 and min(costs.t_f + costs.t_b + costs.t_w) > 0 and costs.t_comm > 0
    for result in results:
        assert result["passes"] == result["expected_passes"] and result["iterations"] == [0, 1]
        assert 0 < result["work"] < result["wall"], "pass times exclude waiting and fit in the wall time"
    if name == "1f1b":  # only fused BW ran: split half and half by default, and its own time kept
        assert costs.t_b == costs.t_w
        assert costs.t_bw == pytest.approx(tuple(b + w for b, w in zip(costs.t_b, costs.t_w, strict=True)))
    else:  # no BW ran: a BW would cost B + W
        assert costs.t_b != costs.t_w and costs.t_bw is None


def run_with_one_chunk(name: str) -> str:
    """A V schedule given a single model chunk: the refusal names both counts."""
    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.schedule import ScheduleError
    from megatron_zb.testing.parallel import init_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT, forward_step

    init_parallel(pp=2)
    toy = ToyGPT()
    model = toy.block(toy.config(2, 1), 0, 2)
    try:
        ForwardBackward(name)(
            forward_step_func=forward_step,
            data_iterator=iter(toy.batches(4)),
            model=model,
            num_microbatches=4,
            seq_length=toy.seq,
            micro_batch_size=toy.micro_batch,
        )
    except ScheduleError as error:
        return str(error)
    return "accepted"


def test_chunk_count_mismatch_is_refused(pool):
    for message in pool.run(run_with_one_chunk, name="zb-v"):
        assert "runs 2 model chunk(s) per rank, got 1" in message and "v placement" in message
