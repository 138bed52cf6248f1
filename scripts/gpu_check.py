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

Run on one GPU: ``python scripts/gpu_check.py --output docs/gpu_check.md`` (``--device cpu`` runs
the same checks small, as a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zb.runtime import linear_split  # noqa: E402
from megatron_zb.runtime.wgrad import WeightGradStore  # noqa: E402


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


def transformer_config(hidden: int, layers: int, heads: int, dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
    )


def gpt(hidden: int, layers: int, heads: int, seq: int, vocab: int, dtype: torch.dtype, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(1234)
    model = GPTModel(
        config=transformer_config(hidden, layers, heads, dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=True,
        post_process=True,
    )
    return model.to(device=device, dtype=dtype)  # the local spec's norms are built in fp32


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
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


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
    deferred = [name for name, p in model.named_parameters() if name in reference and p.grad is None]
    queued = store.queued
    order = list(range(len(data)))
    for microbatch in reversed(order) if reverse else order:
        store.run((0, microbatch))
    store.check_empty()
    ours = grads(model)
    model.zero_grad(set_to_none=True)
    worst = max(
        float((ours[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) for name, ref in reference.items()
    )
    bitwise = all(torch.equal(ours[name], ref) for name, ref in reference.items())
    assert set(ours) == set(reference), sorted(set(ours) ^ set(reference))
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
    assert set(found) == set(reference), sorted(set(found) ^ set(reference))
    return {
        "schedule": name,
        "dtype": str(dtype).removeprefix("torch."),
        "losses_equal": losses == reference_losses,
        "grads_bitwise_equal": all(torch.equal(found[key], value) for key, value in reference.items()),
        "worst_relative": max(
            float((found[key] - value).abs().max() / value.abs().max().clamp_min(1e-30))
            for key, value in reference.items()
        ),
        "profiled_passes": passes,
        "profiled_ms": sum(record.end - record.start for record in profiler.records) * 1e3,
    }


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` (which returns nothing) after two warm-ups."""
    return statistics.median([timed_once(fn, device) for _ in range(repeats + 2)][2:])


def costs(hidden: int, heads: int, seq: int, micro_batch: int, repeats: int, device: torch.device) -> dict:
    """F, B, W and plain backward of one megatron-core transformer layer (local spec), bf16."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = transformer_config(hidden, 1, heads, dtype)
    spec = get_gpt_layer_local_spec()
    layer = TransformerLayer(config, spec.submodules, layer_number=1).to(device=device, dtype=dtype)
    x = torch.randn(seq, micro_batch, hidden, dtype=dtype, device=device, requires_grad=True)
    grad_out = torch.randn(seq, micro_batch, hidden, dtype=dtype, device=device)

    def forward():
        out = layer(x, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    def f_only():
        with torch.no_grad():
            forward()

    def plain_bw():
        forward().backward(grad_out)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    store = WeightGradStore()

    def split_b_then_w() -> tuple[float, float]:
        with store.recording():
            out = forward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        b = timed_once(lambda: _backward_deferred(store, out, grad_out), device)
        w = timed_once(lambda: store.run((0, 0)), device)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return b, w

    def f_with_graph():
        forward()

    t_f = timed(f_with_graph, repeats, device)
    t_f_no_grad = timed(f_only, repeats, device)
    t_fbw = timed(plain_bw, repeats, device)
    pairs = [split_b_then_w() for _ in range(repeats + 2)][2:]
    t_b = statistics.median(b for b, _ in pairs)
    t_w = statistics.median(w for _, w in pairs)
    t_bw = t_fbw - t_f
    return {
        "layer": {"hidden": hidden, "heads": heads, "seq": seq, "micro_batch": micro_batch, "dtype": str(dtype)},
        "t_f_ms": t_f,
        "t_f_no_grad_ms": t_f_no_grad,
        "t_b_ms": t_b,
        "t_w_ms": t_w,
        "t_bw_plain_ms": t_bw,
        "w_over_b": t_w / t_b,
        "b_over_f": t_b / t_f,
        "split_over_plain": (t_b + t_w) / t_bw,
    }


def _backward_deferred(store: WeightGradStore, out: torch.Tensor, grad_out: torch.Tensor) -> None:
    with store.deferring((0, 0)):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a small dry run")
    parser.add_argument("--output", help="write the markdown table here")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; use --device cpu for the dry run")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    import megatron.core

    init(device)
    linear_split.install()
    dtypes = [torch.float32, torch.bfloat16]
    result = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "exactness": [exactness(dtype, device, reverse) for dtype in dtypes for reverse in (False, True)],
    }
    print(json.dumps(result["exactness"], indent=1), flush=True)
    result["runtime"] = [runtime("zb-h1", dtype, device) for dtype in dtypes]
    print(json.dumps(result["runtime"], indent=1), flush=True)
    sizes = [(128, 4, 64, 1)]  # (hidden, heads, seq, micro batch)
    if device.type == "cuda":
        sizes = [(4096, 32, 1024, 4), (4096, 32, 4096, 1), (8192, 64, 4096, 1)]
    repeats = 10 if device.type == "cuda" else 3
    result["costs"] = [costs(*size, repeats, device) for size in sizes]
    print(json.dumps(result["costs"], indent=1), flush=True)
    text = markdown(result)
    if args.output:
        Path(args.output).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
