"""GPTModel chunks for a V placement equal the unpipelined model: layers, init, losses, gradients.

Pure tests check the layer split. Four gloo processes run the rest: each case builds its
chunks with build_gpt_chunks, initialises them placement-independently, runs one iteration,
and compares with a one-block GPTModel (pre and post process, pp=1 config) built in the same
process from the same seed.
"""

from __future__ import annotations

import pytest
import torch

from megatron_zb.megatron.layout import layer_layout, layers_per_block
from megatron_zb.schedule.placement import interleaved, linear, v_shape
from megatron_zb.testing.pool import WorkerPool

TOLERANCE = 1e-5
SEED = 20240607
M = 4
PLAIN_DDP = dict(overlap_grad_reduce=False, use_distributed_optimizer=False)


# -- pure: the layer split ----------------------------------------------------------------------
def test_layers_per_block_splits_evenly():
    assert layers_per_block(8, linear(2)) == [4, 4]
    assert layers_per_block(8, v_shape(2)) == [2, 2, 2, 2]
    assert layers_per_block(8, v_shape(4)) == [1] * 8
    assert layers_per_block(8, v_shape(2), pad=True) == [2, 2, 2, 2]  # padding allowed, not needed


def test_padding_lightens_embedding_and_loss_blocks():
    assert layers_per_block(6, v_shape(2), pad=True) == [1, 2, 2, 1]
    assert layers_per_block(10, v_shape(2), pad=True) == [2, 3, 3, 2]
    assert layers_per_block(14, v_shape(4), pad=True) == [1, 2, 2, 2, 2, 2, 2, 1]
    assert layers_per_block(5, linear(1), pad=True) == [5]


def test_uneven_layer_counts_are_refused_with_counts_that_work():
    with pytest.raises(ValueError) as error:
        layers_per_block(10, v_shape(2))
    message = str(error.value)
    assert "--num-layers 10" in message and "pipeline size 2 x 2 chunk(s)" in message
    assert "--num-layers 8 or 12" in message and "--allow-padding-num-layers" in message
    with pytest.raises(ValueError, match=r"--num-layers 6 or 8$"):
        layers_per_block(7, linear(2))
    with pytest.raises(ValueError) as error:
        layers_per_block(9, v_shape(2), pad=True)
    assert "num_layers + 2 must divide by 4" in str(error.value) and "--num-layers 6 or 10" in str(error.value)
    with pytest.raises(ValueError, match="at least 1"):
        layers_per_block(0, linear(1))


def test_layout_maps_v_blocks_to_global_layers():
    layout = layer_layout(8, v_shape(2))
    ids = {(r, v): layout.get_layer_id_list(vp_stage=v, pp_rank=r) for r in range(2) for v in range(2)}
    assert ids == {(0, 0): [0, 1], (1, 0): [2, 3], (1, 1): [4, 5], (0, 1): [6, 7]}
    assert layout.layout[0][0][0].name == "embedding" and layout.layout[0][1][-1].name == "loss"
    padded = layer_layout(6, v_shape(2), pad=True)
    assert [padded.get_num_layers_to_build(vp_stage=v, pp_rank=0) for v in range(2)] == [1, 1]
    assert padded.get_layer_offset(vp_stage=1, pp_rank=0) == 5
    with pytest.raises(ValueError, match="vp_stage must be given"):
        layout.get_num_layers_to_build(pp_rank=0)


def test_config_takes_the_layout_and_checks_the_layer_count():
    from megatron.core.transformer import TransformerConfig

    fields = dict(hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    config = TransformerConfig(num_layers=8, pipeline_model_parallel_layout=layer_layout(8, v_shape(2)), **fields)
    assert config.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="builds 8 decoder layers .* --num-layers is 6"):
        TransformerConfig(num_layers=6, pipeline_model_parallel_layout=layer_layout(8, v_shape(2)), **fields)
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size"):
        TransformerConfig(
            num_layers=8,
            pipeline_model_parallel_layout=layer_layout(8, interleaved(2, 2)),
            virtual_pipeline_model_parallel_size=4,
            **fields,
        )


# -- in the pool ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(worker_pools) -> WorkerPool:
    return worker_pools.get(4)


def _init_parallel(tp: int, pp: int, placement) -> None:
    from megatron.core import parallel_state

    from megatron_zb.megatron.gpt_model import embedding_ranks
    from megatron_zb.process_groups import destroy_model_parallel

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        get_embedding_ranks=embedding_ranks(placement),
    )


def _build(toy, placement, tp: int, tied: bool, pad: bool, layout: bool = True):
    from megatron.core import parallel_state

    from megatron_zb.megatron.gpt_model import build_gpt_chunks
    from megatron_zb.megatron.init import placement_independent_init

    extra = {"pipeline_model_parallel_layout": layer_layout(toy.layers, placement, pad)} if layout else {}
    config = toy.config(placement.pp, placement.chunks, tp, **extra)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = build_gpt_chunks(
        config,
        placement,
        rank,
        vocab_size=toy.vocab,
        max_sequence_length=toy.seq,
        share_embeddings_and_output_weights=tied,
        layer_spec=toy.layer_spec(config),
        **toy.positions,
    )
    placement_independent_init(chunks, config, SEED)
    return config, chunks


def _reference(toy, tp: int, tied: bool):
    """The whole model as one GPTModel (pp=1 config), initialised from the same seed."""
    from megatron.core.models.gpt import GPTModel

    from megatron_zb.megatron.init import placement_independent_init

    config = toy.config(1, 1, tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=toy.layer_spec(config),
        vocab_size=toy.vocab,
        max_sequence_length=toy.seq,
        share_embeddings_and_output_weights=tied,
        **toy.positions,
    )
    placement_independent_init([model], config, SEED)
    return model


def _compare(chunks: list, reference, slices: dict | None = None) -> tuple[float, int]:
    """Worst relative gradient difference (to each reference parameter's largest entry)."""
    from megatron_zb.megatron.init import placement_independent_names
    from megatron_zb.testing.parallel import gradient

    theirs = dict(placement_independent_names(reference))
    worst, compared = 0.0, 0
    for chunk in chunks:
        for key, param in placement_independent_names(chunk):
            if slices is not None and param not in slices:
                continue
            mine, ref = gradient(param).reshape(-1), gradient(theirs[key]).reshape(-1)
            if slices is not None:
                low, high = slices[param]
                mine, ref = mine[low:high], ref[low:high]
            scale = ref.abs().max().clamp(min=1e-30)
            worst = max(worst, float((mine.float() - ref.float()).abs().max() / scale))
            compared += 1
    return worst, compared


def run_case(
    name: str, pp: int, tp: int = 1, tied: bool = True, layers: int = 8, pad: bool = False, ddp=None, llama=False
):
    """One iteration of ``name`` on chunks from build_gpt_chunks, against the one-block reference."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_zb.megatron.gpt_model import tied_embedding_finalize
    from megatron_zb.megatron.init import placement_independent_names
    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.parallel import reduced_slices
    from megatron_zb.testing.toy_gpt import ToyGPT, reference_step

    runner = ForwardBackward(name, timeout_s=60)
    placement = runner.schedule_for(pp, M).placement
    _init_parallel(tp, pp, placement)
    toy = ToyGPT(layers=layers, llama=llama)
    config, chunks = _build(toy, placement, tp, tied, pad)
    reference = _reference(toy, tp, tied)
    ref_values = dict(placement_independent_names(reference))
    values = {key: p.detach().clone() for chunk in chunks for key, p in placement_independent_names(chunk)}
    mismatched = sorted(key for key, value in values.items() if not torch.equal(value, ref_values[key]))
    layer_numbers = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]

    finalize = finalize_model_grads if ddp is not None else None
    if ddp is not None:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=4000, **ddp)
        chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = tied_embedding_finalize(finalize, placement)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    losses = toy.step(runner, chunks, toy.batches(M, stream=dp_rank))

    # DDP averages over data-parallel replicas: the reference then runs every replica's batches.
    streams = range(dp_size) if ddp is not None else [dp_rank]
    everyone = [batch for stream in streams for batch in toy.batches(M, stream=stream)]
    reference_losses = reference_step([reference], everyone, num_microbatches=len(everyone))
    if ddp is None:
        reference_losses = [None] * (M * dp_rank) + reference_losses
    slices = None
    if ddp is not None and ddp["use_distributed_optimizer"]:
        slices = {}
        for chunk in chunks:
            slices.update(reduced_slices(chunk, dp_rank, dp_size))
    worst, compared = _compare(chunks, reference, slices)
    return {
        "losses": [float(d["lm loss"][0]) for d in losses],
        "reference": reference_losses[dp_rank * M : (dp_rank + 1) * M],
        "worst_grad": worst,
        "compared": compared,
        "mismatched_init": mismatched,
        "init_sums": {key: float(value.double().sum()) for key, value in values.items()},
        "layer_numbers": layer_numbers,
        "dp_rank": dp_rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
    }


def check(results: list[dict], pp: int) -> None:
    loss_ranks = [rank for rank, r in enumerate(results) if r["losses"]]
    assert len(loss_ranks) == len(results) // pp, "one loss rank per pipeline"
    for rank, result in enumerate(results):
        assert not result["mismatched_init"], (
            f"rank {rank}: init differs from the reference for {result['mismatched_init']}"
        )
        if result["losses"]:
            worst = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], result["reference"], strict=True))
            assert worst <= TOLERANCE, f"rank {rank}: loss differs by {worst:.2e}"
        assert result["compared"] > 0, f"rank {rank} compared no gradients"
        assert result["worst_grad"] <= TOLERANCE, f"rank {rank}: gradient differs by {result['worst_grad']:.2e}"


def _pipeline_init(results: list[dict]) -> dict:
    """Every parameter of data-parallel replica 0's pipeline (tp=1), keyed placement-independently."""
    found = {}
    for result in results:
        if result["dp_rank"] == 0:
            found.update(result["init_sums"])
    return found


def _by_stage(results: list[dict], dp_rank: int = 0) -> dict[int, dict]:
    """Data-parallel replica ``dp_rank``'s results by pipeline rank (megatron orders ranks tp, dp, pp)."""
    return {r["pp_rank"]: r for r in results if r["dp_rank"] == dp_rank}


@pytest.fixture(scope="module")
def v_pp2_tied(pool):
    return pool.run(run_case, name="zb-v", pp=2)


def test_v_pp2_tied_matches_unpipelined(v_pp2_tied):
    check(v_pp2_tied, pp=2)
    # pp rank 0 holds blocks 0 and 3, rank 1 blocks 1 and 2; layer numbers are global and 1-based.
    stages = _by_stage(v_pp2_tied)
    assert stages[0]["layer_numbers"] == [[1, 2], [7, 8]]
    assert stages[1]["layer_numbers"] == [[3, 4], [5, 6]]
    assert all(bool(r["losses"]) == (r["pp_rank"] == 0) for r in v_pp2_tied), "V computes the loss on pp rank 0"


def test_linear_and_v_start_from_the_same_model(pool, v_pp2_tied):
    # Tied copies on two ranks: megatron's finalize_model_grads (DDP) all-reduces their gradients.
    results = pool.run(run_case, name="1f1b", pp=2, ddp=PLAIN_DDP)
    check(results, pp=2)
    assert _by_stage(results)[0]["layer_numbers"] == [[1, 2, 3, 4]]
    assert _pipeline_init(results) == _pipeline_init(v_pp2_tied)
    assert _by_stage(results)[1]["losses"] == pytest.approx(_by_stage(v_pp2_tied)[0]["losses"], rel=TOLERANCE)


CASES = {
    "v-pp2-untied-padded": dict(name="zb-v", pp=2, tied=False, layers=6, pad=True),
    "v-pp4-tied": dict(name="zb-v", pp=4),
    "v-pp4-untied": dict(name="zb-v", pp=4, tied=False),
    "v-pp2-tied-distopt": dict(name="zb-v", pp=2, ddp=dict(overlap_grad_reduce=True, use_distributed_optimizer=True)),
    "v-pp2-tied-ddp": dict(name="zb-v", pp=2, ddp=PLAIN_DDP),
}


@pytest.mark.parametrize("case", list(CASES))
def test_v_matches_unpipelined(pool, case):
    kwargs = CASES[case]
    results = pool.run(run_case, **kwargs)
    check(results, kwargs["pp"])
    if kwargs.get("pad"):
        stages = _by_stage(results)
        assert stages[0]["layer_numbers"] == [[1], [6]] and stages[1]["layer_numbers"] == [[2, 3], [4, 5]]


def test_tensor_parallel_init_slices_the_same_model(pool, v_pp2_tied):
    results = pool.run(run_case, name="zb-v", pp=2, tp=2)
    check(results, pp=2)
    # tp=2 x pp=2 (dp=1) sees the same batches as data-parallel replica 0 at tp=1.
    expected = _by_stage(v_pp2_tied)[0]["losses"]
    for result in results:
        if result["pp_rank"] == 0:
            assert result["losses"] == pytest.approx(expected, rel=TOLERANCE)


def run_bf16(pp: int = 2) -> dict:
    """bf16 with Float16Module: which chunk casts its output, and the losses of V against linear."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from megatron_zb import patching
    from megatron_zb.megatron.gpt_model import PlacementFloat16Module, fix_float16_output_cast, loss_chunk
    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.testing.toy_gpt import ToyGPT

    toy = ToyGPT().with_dtype(torch.bfloat16)
    outcome = {}
    for name in ("zb-v", "1f1b"):
        runner = ForwardBackward(name, timeout_s=60)
        placement = runner.schedule_for(pp, M).placement
        _init_parallel(1, pp, placement)
        config, chunks = _build(toy, placement, 1, True, False, layout=name == "zb-v")
        rank = parallel_state.get_pipeline_model_parallel_rank()
        if name == "zb-v":
            outcome["megatron_dtypes"] = _output_dtypes(toy, [Float16Module(config, c) for c in chunks])
        wrapped = fix_float16_output_cast([Float16Module(config, c) for c in chunks], placement, rank)
        assert all(isinstance(w, PlacementFloat16Module) for w in wrapped)
        outcome[f"{name}_dtypes"] = _output_dtypes(toy, wrapped)
        outcome[f"{name}_loss_chunk"] = loss_chunk(placement, rank)
        losses = toy.step(runner, wrapped, toy.batches(M, stream=parallel_state.get_data_parallel_rank()))
        outcome[name] = [float(d["lm loss"][0]) for d in losses]
        patching.undo(patching.MEGATRON_LM)  # the swap is Megatron-LM's run's: undone with it
        assert all(type(w) is Float16Module for w in wrapped)
    outcome["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    outcome["dp_rank"] = parallel_state.get_data_parallel_rank()
    return outcome


def _output_dtypes(toy, wrapped: list) -> list[str]:
    """Each chunk's output dtype for one forward without labels (logits on the loss chunk)."""
    batch = toy.batches(1)[0]
    found = []
    with torch.no_grad():
        for chunk in wrapped:
            pre = chunk.module.pre_process
            hidden = None if pre else torch.randn(toy.seq, toy.micro_batch, toy.hidden, dtype=torch.bfloat16)
            chunk.set_input_tensor(hidden)
            output = chunk(batch["tokens"] if pre else None, batch["position_ids"] if pre else None, None)
            found.append(str(output.dtype).replace("torch.", ""))
    return found


def test_bf16_casts_exactly_the_loss_chunk_output(pool):
    results = pool.run(run_bf16)
    for result in results:
        first = result["pp_rank"] == 0  # V: blocks 0 and 3; linear: block 0
        assert result["zb-v_dtypes"] == (["bfloat16", "float32"] if first else ["bfloat16", "bfloat16"])
        assert result["zb-v_loss_chunk"] == (1 if first else None)
        assert result["1f1b_dtypes"] == (["bfloat16"] if first else ["float32"])
        # megatron's own Float16Module casts the last rank's hidden state and not the V loss chunk
        assert result["megatron_dtypes"] == (["bfloat16", "bfloat16"] if first else ["bfloat16", "float32"])
        assert bool(result["zb-v"]) == first and bool(result["1f1b"]) == (not first)
    for dp_rank in (0, 1):
        stages = _by_stage(results, dp_rank)
        # the same bf16 model and the same computations, placed differently: bit-identical losses
        assert stages[0]["zb-v"] == stages[1]["1f1b"]


def run_with_default_embedding_group() -> str:
    """V with tied embeddings on megatron's default embedding group (first and last rank): refused."""
    from megatron.core import parallel_state

    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.testing.toy_gpt import ToyGPT

    destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        _build(ToyGPT(), v_shape(2), 1, True, False)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_v_refuses_megatron_default_embedding_group(pool):
    for message in pool.run(run_with_default_embedding_group):
        # pp=2 x dp=2: the pipelines are global ranks (0, 2) and (1, 3); V keeps both copies on the first
        assert "get_embedding_ranks=embedding_ranks(placement)" in message
        pairs = (("[0, 2]", "[0]"), ("[1, 3]", "[1]"))
        assert any(f"group is {group}" in message and f"ranks {ranks}" in message for group, ranks in pairs)


def test_llama_layers_init_the_same_model_at_every_tensor_parallel_size(pool):
    """RMSNorm and q/k norm weights, the GLU fc1 (its gate and up halves sliced per rank), 4:1 grouped q/k/v and the
    untied output layer: V at tp=2 starts from, and trains like, V at tp=1."""
    by_tp = {tp: pool.run(run_case, name="zb-v", pp=2, tp=tp, tied=False, llama=True) for tp in (1, 2)}
    for results in by_tp.values():
        check(results, pp=2)
    expected = _by_stage(by_tp[1])[0]["losses"]
    for result in by_tp[2]:
        if result["pp_rank"] == 0:
            assert result["losses"] == pytest.approx(expected, rel=1e-6)
