"""Order-independent dropout (``megatron_zb.megatron.dropout_keys``) on a GPU: the CUDA generator and the RNG tracker.

On CPU (tests/megatron/test_dropout_keys.py) every mask comes from the CPU generator; on a GPU hidden dropout draws
from the CUDA generator and attention dropout from megatron-core's tracker stream ``model-parallel-rng``, which
``dropout_keys`` seeds per layer and forward. One GPU, megatron-core's GPTModel (local spec, 4 layers, dropout 0.3),
three microbatches:

1. other draws between the forwards (CPU, CUDA and a tracker fork) leave every loss and gradient as it was;
2. without the keys the losses differ (the masks are drawn at all, and from the live streams);
3. full activation recomputation replays the keyed masks: the same losses and gradients;
4. a keyed forward gives the CUDA generator and the tracker's states back as it found them.

``python scripts/gpu_dropout_check.py`` prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ, VOCAB, MICRO, MICROBATCHES = 64, 128, 2, 3


def init() -> None:
    from megatron.core import parallel_state, tensor_parallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def model(keyed: bool, **recompute):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_zb.megatron import dropout_keys

    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.3, attention_dropout=0.3,
        use_cpu_initialization=True, **recompute,
    )  # fmt: skip
    torch.manual_seed(0)
    built = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, pre_process=True, post_process=True).cuda()
    if keyed:
        dropout_keys.install([built], seed=77)
    return built


def step(built, noise: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    generator = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(MICROBATCHES):
        if noise:
            torch.rand(3)
            torch.rand(3, device="cuda")
            with get_cuda_rng_tracker().fork():
                torch.rand(3, device="cuda")
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator).cuda()
        positions = torch.arange(SEQ, device="cuda").expand(MICRO, SEQ)
        out = built(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        loss = out.float().mean()
        loss.backward()
        losses.append(float(loss))
    return losses, {name: p.grad.clone() for name, p in built.named_parameters() if p.grad is not None}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def main() -> int:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    init()
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    quiet_losses, quiet_grads = step(model(keyed=True), noise=False)
    noisy_losses, noisy_grads = step(model(keyed=True), noise=True)
    unkeyed_losses, _ = step(model(keyed=False), noise=False)
    recomputed_losses, recomputed_grads = step(model(keyed=True, **full), noise=True)
    keyed = model(keyed=True)
    cuda_before = torch.cuda.get_rng_state()
    tracker_before = {name: state.clone() for name, state in get_cuda_rng_tracker().get_states().items()}
    step(keyed, noise=False)
    tracker_after = get_cuda_rng_tracker().get_states()
    checks = {
        "other draws between forwards: same losses and gradients": noisy_losses == quiet_losses
        and same(noisy_grads, quiet_grads),
        "without keys: other losses": unkeyed_losses != quiet_losses,
        "full recomputation: same losses and gradients": recomputed_losses == quiet_losses
        and same(recomputed_grads, quiet_grads),
        "CUDA generator and tracker given back": torch.equal(cuda_before, torch.cuda.get_rng_state())
        and tracker_before.keys() == tracker_after.keys()
        and all(torch.equal(tracker_before[name], tracker_after[name]) for name in tracker_before),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; tracker streams: {sorted(tracker_before)}")
    print(f"keyed losses {quiet_losses}; unkeyed {unkeyed_losses}")
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}: {name}")
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
