"""B/W split on a GPU: exactness against megatron-core's own backward, and what F, B and W cost.

The CPU suite checks the split on CPU only. On CUDA, autograd runs backward functions on its own
device threads and the GEMMs are cuBLAS's, so this script checks there, with megatron-core's
GPTModel (local layer spec: its own ColumnParallelLinear/RowParallelLinear, no Transformer Engine):

1. exactness: four microbatches, B with W deferred, then the W passes in B order or reversed,
   against plain backward; every parameter gradient (fp32 and bf16 models);
2. the runtime: our executor running zb-h1 at pp=1 with the pass profiler (CUDA-synchronised
   timing) against megatron-core's ``forward_backward_no_pipelining``: losses and gradients;
3. costs: one transformer layer at a GPT size, F, B (W deferred), W and the plain fused backward,
   timed with CUDA events: the T_W/T_B ratio the schedules are planned with, and what the split
   adds to the fused backward.
4. the Llama-3 8B layer (GQA 32:8, SwiGLU, RMSNorm, no linear biases, RoPE, seq 4096): exactness
   (W in B order, fp32 and bf16) and costs (bf16), with megatron-core's local spec and, where
   Transformer Engine is importable, its TE spec (``delay_wgrad_compute``, W by ``backward_dw()``).
5. an MoE layer (hidden 1024, 8 experts top-2, SwiGLU expert FFN 1024, alltoall dispatcher at EP 1,
   aux loss, seq 4096): exactness (W in B order, fp32 and bf16: every parameter and input gradient)
   and costs (bf16), with the local spec (``SequentialMLP`` experts, their linears split by us) and,
   where Transformer Engine is importable, the TE spec with grouped experts (``TEGroupedMLP``,
   ``moe_grouped_gemm``, ``delay_wgrad_compute``, W by ``backward_dw()``).

Parts 1-3 are ``--only gpt``, part 4 is ``--only llama``, part 5 is ``--only moe``. Run on one GPU:
``python scripts/gpu_check.py --output docs/gpu_check.md`` (``--device cpu`` runs the same checks
small, as a dry run; ``--output`` with ``--only`` rewrites only that part of the file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zb.runtime import linear_split, te_wgrad  # noqa: E402
from megatron_zb.runtime.wgrad import WeightGradStore  # noqa: E402


class Llama(NamedTuple):
    """A Llama-style layer (GQA, SwiGLU, RMSNorm, no linear biases, RoPE) and the sizes it is run at."""

    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    ffn: int
    seq: int
    micro_batch: int = 1
    layers: int = 2  # of the block the exactness check runs


LLAMA3_8B = Llama(hidden=4096, heads=32, query_groups=8, kv_channels=128, ffn=14336, seq=4096)
LLAMA_DRY_RUN = Llama(hidden=128, heads=8, query_groups=2, kv_channels=16, ffn=448, seq=64)  # same structure, tiny
ROPE_BASE = 500_000  # Llama 3's
LLAMA_HEADING = "## Llama-3 8B layer"


class Moe(NamedTuple):
    """An MoE layer (attention, then routed experts with SwiGLU FFNs; RMSNorm, no linear biases) and its sizes."""

    hidden: int
    heads: int
    experts: int
    topk: int
    ffn: int  # of each expert
    seq: int
    micro_batch: int = 1
    dispatcher: str = "alltoall"
    aux_loss_coeff: float = 1e-2


MOE_LAYER = Moe(hidden=1024, heads=16, experts=8, topk=2, ffn=1024, seq=4096)
MOE_DRY_RUN = Moe(hidden=64, heads=4, experts=8, topk=2, ffn=64, seq=64)  # same structure, small
MOE_HEADING = "## MoE layer"
PARTS = ("gpt", "llama", "moe")
HEADINGS = {"llama": LLAMA_HEADING, "moe": MOE_HEADING}  # the parts after the first, in file order
# Seconds, guessed for one H100 from the FLOPs and the CPU-side initialisation (not measured on a GPU
# yet; the Llama part builds up to 15 Llama layers on the CPU, 1.6 s each on 2 CPU cores); and the dry run.
ESTIMATE_S = {
    "cuda": {"start-up": 30, "gpt": 90, "llama": 120, "moe": 60},
    "cpu": {"start-up": 30, "gpt": 5, "llama": 5, "moe": 5},
}


def init(device: torch.device) -> None:
    from megatron.core import parallel_state, tensor_parallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type != "cuda":
        from megatron_zb import cpu

        cpu.enable()
    parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def transformer_config(
    hidden: int,
    layers: int,
    heads: int,
    dtype: torch.dtype,
    *,
    llama: Llama | None = None,
    moe: Moe | None = None,
    grouped_gemm: bool = False,
    delay_wgrad: bool = False,
    wgrad_fusion: bool = False,
):
    """A GPT layer's config; with ``llama``, a Llama-style one (its query groups, kv channels and FFN);
    with ``moe``, an MoE one (its experts, SwiGLU, RMSNorm, no linear biases; ``grouped_gemm``: one
    grouped GEMM for all experts, TE spec only).

    ``delay_wgrad``: Transformer Engine layers built from it leave their weight gradients to
    ``backward_dw()``. ``wgrad_fusion``: weight gradients accumulate into ``main_grad``.
    """
    from megatron.core.transformer import TransformerConfig

    architecture = {}
    if llama is not None:
        architecture = {
            "num_query_groups": llama.query_groups,
            "kv_channels": llama.kv_channels,
            "ffn_hidden_size": llama.ffn,
            "gated_linear_unit": True,  # with silu: SwiGLU
            "activation_func": torch.nn.functional.silu,
            "normalization": "RMSNorm",
            "add_bias_linear": False,
        }
    if moe is not None:
        architecture = {
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "normalization": "RMSNorm",
            "add_bias_linear": False,
            "num_moe_experts": moe.experts,
            "moe_router_topk": moe.topk,
            "moe_ffn_hidden_size": moe.ffn,
            "moe_token_dispatcher_type": moe.dispatcher,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": moe.aux_loss_coeff,
            "moe_grouped_gemm": grouped_gemm,
        }
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        gradient_accumulation_fusion=wgrad_fusion,
        **architecture,
    )
    # Set after validation: megatron-core accepts delay_wgrad_compute only with MoE all-to-all
    # overlap; its TE layers pass it on to TE and gate backward_dw() on it.
    config.delay_wgrad_compute = delay_wgrad
    return config


def gpt(hidden: int, layers: int, heads: int, seq: int, vocab: int, dtype: torch.dtype, device: torch.device):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(1234)
    model = GPTModel(
        config=transformer_config(hidden, layers, heads, dtype),
        transformer_layer_spec=layer_spec("local"),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=True,
        post_process=True,
    )
    return model.to(device=device, dtype=dtype)  # the local spec's norms are built in fp32


def layer_spec(spec: str, rms_norm: bool = False, num_experts: int | None = None, grouped_gemm: bool = False):
    """megatron-core's layer spec: "local" (its own linears and norms) or "te" (Transformer Engine's).

    The TE spec's norms follow ``config.normalization``; the local spec is told. With ``num_experts``
    the MLP is an MoE layer: local spec, ``SequentialMLP``; TE spec with ``grouped_gemm``, ``TEGroupedMLP``.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    moe = {"num_experts": num_experts, "moe_grouped_gemm": grouped_gemm} if num_experts else {}
    if spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm" if rms_norm else None, **moe)


def transformer(config, spec: str, dtype: torch.dtype, device: torch.device, *, block: bool = False, like=None):
    """One layer of ``config`` (with ``block``: all its layers and the final norm), ``like``'s weights if given.

    Under ``config.gradient_accumulation_fusion`` every parameter gets the fp32 ``main_grad``
    megatron-core's DDP would give it.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch.manual_seed(1234)
    layer = layer_spec(spec, config.normalization == "RMSNorm", config.num_moe_experts, config.moe_grouped_gemm)
    module = TransformerBlock(config, layer) if block else TransformerLayer(config, layer.submodules, layer_number=1)
    module = module.to(device=device, dtype=dtype)  # the local spec's norms are built in fp32
    if like is not None:
        module.load_state_dict(like.state_dict())
    if config.gradient_accumulation_fusion:
        for p in module.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return module


def llama(s: Llama, spec: str, dtype: torch.dtype, device: torch.device, *, block: bool, **options):
    """The Llama layer (with ``block``: ``s.layers`` of them); ``options``: ``transformer_config``'s and ``like``."""
    like = options.pop("like", None)
    config = transformer_config(s.hidden, s.layers if block else 1, s.heads, dtype, llama=s, **options)
    return transformer(config, spec, dtype, device, block=block, like=like)


def rotary(s: Llama, device: torch.device) -> torch.Tensor:
    """RoPE frequencies for ``s.seq`` positions, as GPTModel hands them to its layers."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(s.kv_channels, rotary_percent=1.0, rotary_base=ROPE_BASE)(s.seq).to(device)


def batches(count: int, seq: int, vocab: int, device: torch.device) -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    found = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (2, seq + 1), generator=generator)
        found.append(
            {
                "input_ids": tokens[:, :-1].to(device),
                "labels": tokens[:, 1:].to(device),
                "position_ids": torch.arange(seq).expand(2, seq).contiguous().to(device),
            }
        )
    return found


def loss_of(model, batch: dict) -> torch.Tensor:
    losses = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])
    return losses.float().mean()


def grads(model) -> dict[str, torch.Tensor]:
    """The gradients that have arrived: ``.grad``, or a ``main_grad`` something accumulated into."""
    found = {}
    for name, p in model.named_parameters():
        grad = p.grad
        main_grad = getattr(p, "main_grad", None)
        if grad is None and main_grad is not None and bool(main_grad.any()):
            grad = main_grad
        if grad is not None:
            found[name] = grad.detach().float().clone()
    return found


def clear(model) -> None:
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()


def compare(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """(bit for bit equal, worst relative difference) over the same names."""
    assert set(ours) == set(reference), sorted(set(ours) ^ set(reference))
    bitwise = all(torch.equal(ours[name], ref) for name, ref in reference.items())
    worst = max(
        float((ours[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) for name, ref in reference.items()
    )
    return bitwise, worst


def exactness(dtype: torch.dtype, device: torch.device, reverse: bool) -> dict:
    """Split (B now, W later, in B order or reversed) against plain backward, four microbatches."""
    hidden, layers, heads, seq, vocab = 256, 2, 4, 128, 512
    model = gpt(hidden, layers, heads, seq, vocab, dtype, device)
    data = batches(4, seq, vocab, device)
    for batch in data:
        loss_of(model, batch).backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)

    store = WeightGradStore()
    for microbatch, batch in enumerate(data):
        with store.recording():
            value = loss_of(model, batch)
        with store.deferring((0, microbatch)):
            value.backward()
    deferred = set(reference) - set(grads(model))
    queued = store.queued
    order = list(range(len(data)))
    for microbatch in reversed(order) if reverse else order:
        store.run((0, microbatch))
    store.check_empty()
    ours = grads(model)
    model.zero_grad(set_to_none=True)
    bitwise, worst = compare(ours, reference)
    assert deferred, "no weight gradient was deferred: the split did not engage"
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "w_order": "reversed" if reverse else "B order",
        "parameters": len(reference),
        "deferred_until_w": len(deferred),
        "w_jobs": queued,
        "bitwise_equal": bitwise,
        "worst_relative": worst,
    }


def runtime(name: str, dtype: torch.dtype, device: torch.device) -> dict:
    """Our executor (pp=1, W split) against megatron-core's no-pipelining schedule; the profiler on this device."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_zb.runtime import ForwardBackward
    from megatron_zb.runtime.profiler import PassProfiler
    from megatron_zb.testing.toy_gpt import forward_step

    seq, vocab, m = 128, 512, 4
    model = gpt(256, 2, 4, seq, vocab, dtype, device)
    generator = torch.Generator().manual_seed(11)
    data = []
    for _ in range(m):
        tokens = torch.randint(0, vocab, (2, seq + 1), generator=generator)
        mask = (torch.rand(2, seq, generator=generator) > 0.1).float()
        data.append(
            {
                "tokens": tokens[:, :-1].contiguous().to(device),
                "labels": tokens[:, 1:].contiguous().to(device),
                "loss_mask": mask.to(device),
                "position_ids": torch.arange(seq).expand(2, seq).contiguous().to(device),
            }
        )
    common = dict(forward_step_func=forward_step, model=[model], num_microbatches=m, seq_length=seq, micro_batch_size=2)
    theirs = forward_backward_no_pipelining(data_iterator=iter(data), **common)
    reference = grads(model)
    model.zero_grad(set_to_none=True)
    profiler = PassProfiler(device)
    profiler.start()
    ours = ForwardBackward(name, timeout_s=60, profiler=profiler)(data_iterator=[iter(data)], **common)
    profiler.stop()
    found = grads(model)
    model.zero_grad(set_to_none=True)
    losses = [float(item["lm loss"][0]) for item in ours]
    reference_losses = [float(item["lm loss"][0]) for item in theirs]
    passes = sorted({record.pass_.kind.name for record in profiler.records if record.pass_.kind.is_compute})
    bitwise, worst = compare(found, reference)
    return {
        "schedule": name,
        "dtype": str(dtype).removeprefix("torch."),
        "losses_equal": losses == reference_losses,
        "grads_bitwise_equal": bitwise,
        "worst_relative": worst,
        "profiled_passes": passes,
        "profiled_ms": sum(record.end - record.start for record in profiler.records) * 1e3,
    }


class SplitCheck(NamedTuple):
    reference: dict  # the plain backward's parameter gradients
    after_b: dict  # the split's, after B only
    deferred: set  # the parameters whose gradient waited for W
    delayed: list  # the TE layers deferring by delay_wgrad_compute
    queued: int  # W jobs queued
    bitwise: bool
    worst: float


def split_against_plain(split, plain, forward, shape, dtype, device, te: bool, check=None) -> SplitCheck:
    """Four microbatches through ``plain`` (plain backward) and ``split`` (B with W deferred, then the Ws in B
    order): every parameter gradient and the input gradients compared. ``check(delayed)``: None, or what is wrong
    with the layers that defer by delay_wgrad_compute."""
    generator = torch.Generator().manual_seed(7)
    data = []
    for _ in range(4):
        x = torch.randn(shape, generator=generator).to(device, dtype).requires_grad_()
        data.append((x, torch.randn(shape, generator=generator).to(device, dtype)))

    def input_grads() -> dict[str, torch.Tensor]:
        found = {f"input {microbatch}": x.grad.float().clone() for microbatch, (x, _) in enumerate(data)}
        for x, _ in data:
            x.grad = None
        return found

    for x, grad_out in data:
        forward(plain, x).backward(grad_out)
    reference = grads(plain)
    reference_inputs = input_grads()
    clear(plain)
    del plain

    store = WeightGradStore()
    delayed = te_wgrad.delayed_wgrad_layers(split)
    assert delayed or not te, "no Transformer Engine layer defers its weight gradient (need_backward_dw())"
    problem = check(delayed) if check is not None else None
    assert problem is None, problem
    for microbatch, (x, grad_out) in enumerate(data):
        with store.recording():
            out = forward(split, x)
        with store.deferring((0, microbatch), [te_wgrad.BackwardDwJob(delayed)] if delayed else []):
            out.backward(grad_out)
    after_b = grads(split)
    queued = store.queued
    for microbatch in range(len(data)):
        store.run((0, microbatch))
    store.check_empty()
    bitwise, worst = compare(grads(split) | input_grads(), reference | reference_inputs)
    return SplitCheck(reference, after_b, set(reference) - set(after_b), delayed, queued, bitwise, worst)


def llama_exactness(s: Llama, spec: str, dtype: torch.dtype, device: torch.device) -> dict:
    """B with W deferred, then the Ws in B order, against the plain backward of the same weights.

    A block of ``s.layers`` Llama layers, four microbatches; every parameter gradient and the input
    gradients. TE spec: the split block defers by delay_wgrad_compute, the plain one is a copy built
    without it, and both accumulate weight gradients into ``main_grad`` as under megatron-core's DDP
    (without it, TE's ``backward_dw()`` sets ``.grad`` instead of adding to it).
    """
    te = spec == "te"
    split = llama(s, spec, dtype, device, block=True, delay_wgrad=te, wgrad_fusion=te)
    plain = llama(s, spec, dtype, device, block=True, wgrad_fusion=te, like=split) if te else split
    rope = rotary(s, device)

    def forward(block, x):
        out = block(x, attention_mask=None, rotary_pos_emb=rope)
        return out[0] if isinstance(out, tuple) else out

    found = split_against_plain(split, plain, forward, (s.seq, s.micro_batch, s.hidden), dtype, device, te)
    reference, queued, bitwise, worst = found.reference, found.queued, found.bitwise, found.worst
    deferred = found.deferred
    assert deferred, "no weight gradient was deferred: the split did not engage"
    return {
        "spec": spec,
        "dtype": str(dtype).removeprefix("torch."),
        "layers": s.layers,
        "seq": s.seq,
        "parameters": len(reference),
        "deferred_until_w": len(deferred),
        "w_jobs": queued,
        "bitwise_equal": bitwise,
        "worst_relative": worst,
    }


def llama_costs(s: Llama, spec: str, repeats: int, device: torch.device) -> dict:
    """F, B (W deferred), W and plain backward of one Llama layer, bf16 (fp32 on the CPU dry run)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    te = spec == "te"
    split = llama(s, spec, dtype, device, block=False, delay_wgrad=te)
    plain = llama(s, spec, dtype, device, block=False, like=split) if te else split
    timings = layer_costs(plain, split, s.seq, s.micro_batch, rotary(s, device), repeats, device)
    return {"spec": spec, "dtype": str(dtype).removeprefix("torch."), **timings}


def te_unavailable(device: torch.device) -> str | None:
    """Why the Transformer Engine rows cannot run here; None when they can."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # ImportError, or a build that does not load with this torch or CUDA
        return f"Transformer Engine is not importable ({type(error).__name__}: {error})"
    if device.type != "cuda":
        return "Transformer Engine runs on CUDA only"
    from megatron.core.utils import is_te_min_version

    if not is_te_min_version("2.3.0"):
        return "delay_wgrad_compute needs Transformer Engine 2.3 or later"
    return None


def te_version() -> str | None:
    try:
        import transformer_engine
    except Exception:
        return None
    return getattr(transformer_engine, "__version__", "?")


def attempt(label: dict, fn, *args) -> dict:
    """``fn(*args)``'s row, or ``label`` with the error (traceback printed): one failing row keeps the others."""
    try:
        return fn(*args)
    except Exception as error:
        traceback.print_exc()
        return {**label, "error": f"{type(error).__name__}: {error}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def spec_part(title: str, s, exactness_of, costs_of, repeats: int, device: torch.device) -> dict:
    """One layer (``s``) with the local spec and, where Transformer Engine can run, the TE spec: exactness in fp32
    and bf16 (``exactness_of``) and costs (``costs_of``), each row kept when another fails."""
    specs, skipped = ["local"], {}
    reason = te_unavailable(device)
    if reason is None:
        specs.append("te")
    else:
        skipped["te"] = reason
        print(f"{title}, TE spec: skipped: {reason}", flush=True)
    exact = [
        attempt({"spec": spec, "dtype": str(dtype).removeprefix("torch.")}, exactness_of, s, spec, dtype, device)
        for spec in specs
        for dtype in (torch.float32, torch.bfloat16)
    ]
    print(json.dumps(exact, indent=1), flush=True)
    cost = [attempt({"spec": spec}, costs_of, s, spec, repeats, device) for spec in specs]
    print(json.dumps(cost, indent=1), flush=True)
    return {
        "shape": s._asdict(),
        "transformer_engine": te_version(),
        "skipped": skipped,
        "exactness": exact,
        "costs": cost,
    }


def llama_part(s: Llama, repeats: int, device: torch.device) -> dict:
    """The Llama layer with the local spec and, where Transformer Engine can run, the TE spec."""
    return spec_part("Llama layer", s, llama_exactness, llama_costs, repeats, device)


def moe(s: Moe, spec: str, dtype: torch.dtype, device: torch.device, **options):
    """One MoE layer (TE spec: grouped experts); ``options``: ``transformer_config``'s and ``like``."""
    like = options.pop("like", None)
    config = transformer_config(s.hidden, 1, s.heads, dtype, moe=s, grouped_gemm=spec == "te", **options)
    return transformer(config, spec, dtype, device, like=like)


def fresh_aux_loss_scale() -> None:
    """megatron-core's class-global aux-loss backward scale: unset, so the first backward makes it 1."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def moe_exactness(s: Moe, spec: str, dtype: torch.dtype, device: torch.device) -> dict:
    """B with W deferred, then the Ws in B order, against the plain backward of the same MoE layer.

    Four microbatches; every parameter gradient and the input gradients. Local spec: the experts'
    linears (``SequentialMLP``) and attention's go through our split. TE spec: the split layer defers by
    delay_wgrad_compute (attention's TE linears and the experts' grouped linears), the plain one is a
    copy built without it; both accumulate weight gradients into ``main_grad`` as under DDP. The
    router computes its weight gradient in B either way, the aux loss backpropagates in B.
    """
    fresh_aux_loss_scale()
    te = spec == "te"
    split = moe(s, spec, dtype, device, delay_wgrad=te, wgrad_fusion=te)
    plain = moe(s, spec, dtype, device, wgrad_fusion=te, like=split) if te else split

    def forward(layer, x):
        out = layer(x, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    def grouped_experts_defer(delayed: list) -> str | None:
        if not te or any("Grouped" in type(layer).__name__ for layer in delayed):
            return None
        return "the experts' grouped linears do not defer their weight gradients"

    shape = (s.seq, s.micro_batch, s.hidden)
    found = split_against_plain(split, plain, forward, shape, dtype, device, te, check=grouped_experts_defer)
    reference, after_b, deferred, delayed = found.reference, found.after_b, found.deferred, found.delayed
    queued, bitwise, worst = found.queued, found.bitwise, found.worst
    assert deferred, "no weight gradient was deferred: the split did not engage"
    experts = [name for name in reference if ".experts." in name]
    routers = [name for name in reference if name.endswith("router.weight")]
    return {
        "spec": spec,
        "dtype": str(dtype).removeprefix("torch."),
        "experts_module": type(split.mlp.experts).__name__,
        "seq": s.seq,
        "parameters": len(reference),
        "deferred_until_w": len(deferred),
        "expert_weights": len(experts),
        "expert_weights_deferred": sum(name in deferred for name in experts),
        "expert_weights_nonzero": sum(bool(reference[name].any()) for name in experts),
        "router_final_after_b": bool(routers)
        and all(name in after_b and torch.equal(after_b[name], reference[name]) for name in routers),
        "delayed_te_layers": len(delayed),
        "w_jobs": queued,
        "bitwise_equal": bitwise,
        "worst_relative": worst,
    }


def moe_costs(s: Moe, spec: str, repeats: int, device: torch.device) -> dict:
    """F, B (W deferred), W and plain backward of one MoE layer, bf16 (fp32 on the CPU dry run)."""
    fresh_aux_loss_scale()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    te = spec == "te"
    split = moe(s, spec, dtype, device, delay_wgrad=te)
    plain = moe(s, spec, dtype, device, like=split) if te else split
    timings = layer_costs(plain, split, s.seq, s.micro_batch, None, repeats, device)
    return {"spec": spec, "dtype": str(dtype).removeprefix("torch."), **timings}


def moe_part(s: Moe, repeats: int, device: torch.device) -> dict:
    """The MoE layer with the local spec and, where Transformer Engine can run, the TE spec (grouped experts)."""
    return spec_part("MoE layer", s, moe_exactness, moe_costs, repeats, device)


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` (which returns nothing) after two warm-ups."""
    return statistics.median([timed_once(fn, device) for _ in range(repeats + 2)][2:])


def costs(hidden: int, heads: int, seq: int, micro_batch: int, repeats: int, device: torch.device) -> dict:
    """F, B, W and plain backward of one megatron-core transformer layer (local spec), bf16."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = transformer(transformer_config(hidden, 1, heads, dtype), "local", dtype, device)
    return {
        "layer": {"hidden": hidden, "heads": heads, "seq": seq, "micro_batch": micro_batch, "dtype": str(dtype)},
        **layer_costs(layer, layer, seq, micro_batch, None, repeats, device),
    }


def layer_costs(plain, split, seq: int, micro_batch: int, rope, repeats: int, device: torch.device) -> dict:
    """F, B (W deferred), W and the plain backward of one layer, in milliseconds.

    ``split`` is ``plain``, or the same layer built with Transformer Engine's delay_wgrad_compute,
    whose W is ``backward_dw()`` on its delayed layers (``te_wgrad``), as in the executor.
    """
    hidden = plain.config.hidden_size
    dtype = next(plain.parameters()).dtype
    x = torch.randn(seq, micro_batch, hidden, dtype=dtype, device=device, requires_grad=True)
    grad_out = torch.randn(seq, micro_batch, hidden, dtype=dtype, device=device)
    delayed = te_wgrad.delayed_wgrad_layers(split)

    def forward(layer=plain):
        out = layer(x, attention_mask=None, rotary_pos_emb=rope)
        return out[0] if isinstance(out, tuple) else out

    def f_only():
        with torch.no_grad():
            forward()

    def plain_bw():
        forward().backward(grad_out)
        plain.zero_grad(set_to_none=True)
        x.grad = None

    store = WeightGradStore()

    def split_b_then_w() -> tuple[float, float]:
        with store.recording():
            out = forward(split)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fifo = [te_wgrad.BackwardDwJob(delayed)] if delayed else []
        b = timed_once(lambda: _backward_deferred(store, out, grad_out, fifo), device)
        w = timed_once(lambda: store.run((0, 0)), device)
        split.zero_grad(set_to_none=True)
        x.grad = None
        return b, w

    def f_with_graph():
        forward()

    t_f = timed(f_with_graph, repeats, device)
    t_f_no_grad = timed(f_only, repeats, device)
    t_fbw = timed(plain_bw, repeats, device)
    pairs = [split_b_then_w() for _ in range(repeats + 2)][2:]
    store.check_empty()
    t_b = statistics.median(b for b, _ in pairs)
    t_w = statistics.median(w for _, w in pairs)
    t_bw = t_fbw - t_f
    return {
        "t_f_ms": t_f,
        "t_f_no_grad_ms": t_f_no_grad,
        "t_b_ms": t_b,
        "t_w_ms": t_w,
        "t_bw_plain_ms": t_bw,
        "w_over_b": t_w / t_b,
        "b_over_f": t_b / t_f,
        "split_over_plain": (t_b + t_w) / t_bw,
    }


def _backward_deferred(store: WeightGradStore, out: torch.Tensor, grad_out: torch.Tensor, fifo=()) -> None:
    with store.deferring((0, 0), fifo):
        out.backward(grad_out)


def timed_once(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def markdown(result: dict) -> str:
    lines = [
        "# B/W split on a GPU",
        "",
        "Measured with `python scripts/gpu_check.py --output docs/gpu_check.md` on "
        f"{result['device_name']} (torch {result['torch']}, megatron-core {result['megatron_core']}, "
        "local layer spec: no Transformer Engine, no apex).",
        "",
        "Exactness: a 2-layer GPTModel (hidden 256, seq 128), four microbatches; B with the weight gradients",
        "deferred, then the four W passes in B order or reversed, against megatron-core's plain backward.",
        "",
        "| dtype | W order | parameters with gradients | deferred to W | W jobs | bitwise equal | worst relative |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["exactness"]:
        lines.append(
            f"| {row['dtype']} | {row['w_order']} | {row['parameters']} | {row['deferred_until_w']} | "
            f"{row['w_jobs']} | {'yes' if row['bitwise_equal'] else 'no'} | {row['worst_relative']:.2e} |"
        )
    lines += [
        "",
        "The runtime: our executor running zb-h1 at pp=1 (F, B, W per microbatch, the pass profiler on)",
        "against megatron-core's `forward_backward_no_pipelining`, same GPTModel and data:",
        "",
        "| schedule | dtype | losses equal | gradients bitwise equal | worst relative | passes profiled |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["runtime"]:
        lines.append(
            f"| {row['schedule']} | {row['dtype']} | {'yes' if row['losses_equal'] else 'no'} | "
            f"{'yes' if row['grads_bitwise_equal'] else 'no'} | {row['worst_relative']:.2e} | "
            f"{', '.join(row['profiled_passes'])} |"
        )
    lines += [
        "",
        "Costs of one transformer layer (CUDA events, median of the timed repeats; B with W deferred):",
        "",
        "| layer | T_F (ms) | T_B (ms) | T_W (ms) | plain B+W (ms) | T_W/T_B | T_B/T_F | split B+W / plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["costs"]:
        layer = row["layer"]
        lines.append(
            f"| h {layer['hidden']}, heads {layer['heads']}, seq {layer['seq']}, mb {layer['micro_batch']} | "
            f"{row['t_f_ms']:.3f} | {row['t_b_ms']:.3f} | {row['t_w_ms']:.3f} | {row['t_bw_plain_ms']:.3f} | "
            f"{row['w_over_b']:.2f} | {row['b_over_f']:.2f} | {row['split_over_plain']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def cost_lines(part: dict, notes: list[str], intro: str) -> list[str]:
    """The costs table of a layer part (a failed row becomes a note)."""
    lines = [
        "",
        f"{intro} (CUDA events, median of the timed repeats; B with W deferred):",
        "",
        "| spec | dtype | T_F (ms) | T_B (ms) | T_W (ms) | plain B+W (ms) | T_W/T_B | T_B/T_F | split B+W / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in part["costs"]:
        if "error" in row:
            notes.append(f"- {row['spec']} spec costs: failed: `{row['error']}`")
            continue
        lines.append(
            f"| {row['spec']} | {row['dtype']} | {row['t_f_ms']:.3f} | {row['t_b_ms']:.3f} | {row['t_w_ms']:.3f} | "
            f"{row['t_bw_plain_ms']:.3f} | {row['w_over_b']:.2f} | {row['b_over_f']:.2f} | "
            f"{row['split_over_plain']:.3f} |"
        )
    return lines


def llama_markdown(result: dict) -> str:
    part = result["llama"]
    s = Llama(**part["shape"])
    lines = [
        LLAMA_HEADING,
        "",
        f"Measured with `{result['command']}` on {result['device_name']} (torch {result['torch']}, megatron-core "
        f"{result['megatron_core']}, Transformer Engine {part['transformer_engine'] or 'not installed'}).",
        "",
        f"The layer: hidden {s.hidden}, GQA {s.heads} heads : {s.query_groups} query groups (kv channels "
        f"{s.kv_channels}), SwiGLU FFN {s.ffn}, RMSNorm, no linear biases, RoPE (base {ROPE_BASE}); seq {s.seq}, "
        f"micro batch {s.micro_batch}. Local spec: megatron-core's own linears and norms, W queued by our split;",
        "TE spec: Transformer Engine's layers built with `delay_wgrad_compute`, W by their `backward_dw()`.",
        "",
        f"Exactness: a block of {s.layers} such layers (final RMSNorm included), four microbatches; B with the weight",
        "gradients deferred, then the four W passes in B order, against the plain backward of the same weights (TE",
        "spec: a copy built without `delay_wgrad_compute`; both accumulate weight gradients into `main_grad`, as",
        "under megatron-core's DDP). Compared: every parameter gradient and the four input gradients.",
        "",
        "| spec | dtype | parameters with gradients | deferred to W | W jobs | bitwise equal | worst relative |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = [f"- {spec} spec: skipped: {reason}" for spec, reason in part["skipped"].items()]
    for row in part["exactness"]:
        if "error" in row:
            notes.append(f"- {row['spec']} spec, {row['dtype']} exactness: failed: `{row['error']}`")
            continue
        lines.append(
            f"| {row['spec']} | {row['dtype']} | {row['parameters']} | {row['deferred_until_w']} | {row['w_jobs']} | "
            f"{'yes' if row['bitwise_equal'] else 'no'} | {row['worst_relative']:.2e} |"
        )
    lines += cost_lines(part, notes, "Costs of one such layer")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def moe_markdown(result: dict) -> str:
    part = result["moe"]
    s = Moe(**part["shape"])
    lines = [
        MOE_HEADING,
        "",
        f"Measured with `{result['command']}` on {result['device_name']} (torch {result['torch']}, megatron-core "
        f"{result['megatron_core']}, Transformer Engine {part['transformer_engine'] or 'not installed'}).",
        "",
        f"The layer: one megatron-core TransformerLayer, hidden {s.hidden}, {s.heads} heads, then an MoE MLP of "
        f"{s.experts} experts, top-{s.topk}, SwiGLU expert FFN {s.ffn}, {s.dispatcher} dispatcher at EP 1, aux loss "
        f"(coefficient {s.aux_loss_coeff:g}); RMSNorm, no linear biases; seq {s.seq}, micro batch {s.micro_batch}.",
        "Local spec: `SequentialMLP` experts (megatron-core's own linears), W queued by our split; TE spec:",
        "`TEGroupedMLP` (`moe_grouped_gemm`) and TE attention linears built with `delay_wgrad_compute`, W by",
        "their `backward_dw()`. The router's weight gradient is computed in B either way.",
        "",
        "Exactness: four microbatches; B with the weight gradients deferred, then the four W passes in B order,",
        "against the plain backward of the same weights (TE spec: a copy built without `delay_wgrad_compute`;",
        "both accumulate weight gradients into `main_grad`, as under megatron-core's DDP). Compared: every",
        "parameter gradient and the four input gradients. Expert weights: deferred to W / with a non-zero",
        "gradient (an expert that got tokens) / all.",
        "",
        "| spec | experts | dtype | parameters with gradients | deferred to W | expert weights | router final after B "
        "| W jobs | bitwise equal | worst relative |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = [f"- {spec} spec: skipped: {reason}" for spec, reason in part["skipped"].items()]
    for row in part["exactness"]:
        if "error" in row:
            notes.append(f"- {row['spec']} spec, {row['dtype']} exactness: failed: `{row['error']}`")
            continue
        lines.append(
            f"| {row['spec']} | {row['experts_module']} | {row['dtype']} | {row['parameters']} | "
            f"{row['deferred_until_w']} | {row['expert_weights_deferred']} / {row['expert_weights_nonzero']} / "
            f"{row['expert_weights']} | {'yes' if row['router_final_after_b'] else 'no'} | {row['w_jobs']} | "
            f"{'yes' if row['bitwise_equal'] else 'no'} | {row['worst_relative']:.2e} |"
        )
    lines += cost_lines(part, notes, "Costs of the layer")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, sections: dict[str, str]) -> None:
    """Write the parts that ran; keep the other parts of an existing file (GPT first, then Llama, then MoE)."""
    old = path.read_text() if path.exists() else ""
    starts = {}
    for part, heading in HEADINGS.items():
        found = re.search(rf"^{re.escape(heading)}\s*$", old, re.MULTILINE)
        if found:
            starts[part] = found.start()
    bounds = sorted([*starts.values(), len(old)])
    kept = {"gpt": old[: bounds[0]]}
    for part, start in starts.items():
        kept[part] = old[start : min(b for b in bounds if b > start)]
    texts = [sections.get(part, kept.get(part, "")) for part in PARTS]
    path.write_text("\n".join(text.rstrip("\n") + "\n" for text in texts if text.strip()))


def gpt_part(device: torch.device) -> dict:
    """Parts 1-3: the GPTModel checks and the GPT-size layer costs."""
    dtypes = [torch.float32, torch.bfloat16]
    result = {"exactness": [exactness(dtype, device, reverse) for dtype in dtypes for reverse in (False, True)]}
    print(json.dumps(result["exactness"], indent=1), flush=True)
    result["runtime"] = [runtime("zb-h1", dtype, device) for dtype in dtypes]
    print(json.dumps(result["runtime"], indent=1), flush=True)
    sizes = [(128, 4, 64, 1)]  # (hidden, heads, seq, micro batch)
    if device.type == "cuda":
        sizes = [(4096, 32, 1024, 4), (4096, 32, 4096, 1), (8192, 64, 4096, 1)]
    result["costs"] = [costs(*size, repeats(device), device) for size in sizes]
    print(json.dumps(result["costs"], indent=1), flush=True)
    return result


def repeats(device: torch.device) -> int:
    return 10 if device.type == "cuda" else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a small dry run")
    parser.add_argument(
        "--only",
        choices=PARTS,
        help="run one part: gpt (checks 1-3), llama (the Llama-3 8B layer) or moe (an MoE layer)",
    )
    parser.add_argument("--output", help="write the markdown tables here (with --only: that part of the file)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; use --device cpu for the dry run")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    parts = [args.only] if args.only else list(PARTS)
    where = "one H100; a guess, not yet measured on a GPU" if device.type == "cuda" else "CPU dry run"
    estimate = {part: ESTIMATE_S[device.type][part] for part in ["start-up", *parts]}
    listed = ", ".join(f"{part} ~{seconds} s" for part, seconds in estimate.items())
    print(f"estimated time ({where}): {listed}; in all ~{sum(estimate.values())} s", flush=True)
    import megatron.core

    init(device)
    linear_split.install()
    result = {
        "command": " ".join(["python scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "elapsed_s": {},
    }
    sections = {}
    for part in parts:
        begin = time.perf_counter()
        if part == "gpt":
            result |= gpt_part(device)
            sections[part] = markdown(result)
        elif part == "llama":
            result["llama"] = llama_part(LLAMA3_8B if device.type == "cuda" else LLAMA_DRY_RUN, repeats(device), device)
            sections[part] = llama_markdown(result)
        else:
            result["moe"] = moe_part(MOE_LAYER if device.type == "cuda" else MOE_DRY_RUN, repeats(device), device)
            sections[part] = moe_markdown(result)
        result["elapsed_s"][part] = round(time.perf_counter() - begin, 1)
        print(f"part {part}: {result['elapsed_s'][part]} s", flush=True)
    if args.output:
        write_markdown(Path(args.output), sections)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("\n".join(sections[part] for part in parts))
    dist.destroy_process_group()
    rows = [
        row for part in ("llama", "moe") if part in result for row in result[part]["exactness"] + result[part]["costs"]
    ]
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
