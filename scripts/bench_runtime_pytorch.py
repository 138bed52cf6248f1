"""PyTorch's own pipelining runtime as ``bench_runtime.py``'s peer: the same sizes, its schedules, its 1F1B.

torch.distributed.pipelining splits a plain PyTorch GPT (``TorchGPT``: the toy GPT's sizes, with
``nn.Linear`` layers whose backward PyTorch can split into input and weight gradients) into
the blocks of each schedule's placement. Which rank runs which block comes from the order
``bench_vs_pytorch.imported`` reads out of the schedule class, so the V of ScheduleZBVZeroBubble
and the loop of ScheduleInterleavedZeroBubble are PyTorch's own. The ratio to compare with ours
is each schedule's iteration over PyTorch's Schedule1F1B in the same round.
"""

from __future__ import annotations

import torch
from bench_vs_pytorch import TORCH_SCHEDULES, imported
from torch import nn
from torch.nn import functional

# Label in the tables -> PyTorch schedule class; the first is the reference of the others.
PEERS = {
    "torch-1f1b": "Schedule1F1B",
    "torch-zbv": "ScheduleZBVZeroBubble",
    "torch-dualpipev": "ScheduleDualPipeV",
    "torch-interleaved-zb": "ScheduleInterleavedZeroBubble",
}
REFERENCE = "torch-1f1b"


class Layer(nn.Module):
    """A pre-norm GPT layer (attention, then a 4x GELU MLP), batch first."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(functional.gelu(self.fc1(self.norm2(x))))


class TorchGPT(nn.Module):
    """Block ``block`` of ``blocks``: its share of the layers, the embedding on the first, output layer on the last."""

    def __init__(self, model: dict, block: int, blocks: int, seed: int = 1234):
        super().__init__()
        torch.manual_seed(seed + block)
        hidden, vocab, seq = model["hidden"], model["vocab"], model["seq"]
        self.first, self.last = block == 0, block == blocks - 1
        self.embedding = nn.Embedding(vocab, hidden) if self.first else None
        self.positions = nn.Parameter(torch.randn(seq, hidden) * 0.02) if self.first else None
        self.layers = nn.ModuleList(Layer(hidden, model["heads"]) for _ in range(model["layers"] // blocks))
        self.norm = nn.LayerNorm(hidden) if self.last else None
        self.output = nn.Linear(hidden, vocab, bias=False) if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embedding(x) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)) if self.last else x


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Peer:
    """One PyTorch schedule on this rank: its stages built, one ``step`` per iteration over ``m`` microbatches."""

    def __init__(self, label: str, pp: int, m: int, model: dict, group):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules

        name = PEERS[label]
        per_rank = TORCH_SCHEDULES[name][0]
        placement = imported(name, pp, m, per_rank).placement
        rank = group.rank()
        blocks = placement.num_stages
        mine = [b for b in range(blocks) if placement.rank_of(b) == rank]
        self.has_first, self.has_last = 0 in mine, blocks - 1 in mine
        self.stages = [
            PipelineStage(TorchGPT(model, b, blocks), b, blocks, torch.device("cpu"), group=group) for b in mine
        ]
        cls = getattr(torch_schedules, name)
        self.schedule = cls(self.stages[0] if per_rank == 1 else self.stages, m, loss_fn=loss)
        generator = torch.Generator().manual_seed(4321)
        tokens = torch.randint(0, model["vocab"], (m * model["micro_batch"], model["seq"] + 1), generator=generator)
        self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(self) -> None:
        for stage in self.stages:
            stage.submod.zero_grad(set_to_none=False)
        args = (self.inputs,) if self.has_first else ()
        target = self.labels if self.has_last else None
        self.schedule.step(*args, target=target, return_outputs=False)


def predicted(pp: int, m: int, costs) -> dict[str, float]:
    """Makespan our simulator gives each PyTorch order with ``costs`` (the megatron-core model's)."""
    from megatron_zb.schedule import simulate

    found = {}
    for label, name in PEERS.items():
        schedule = imported(name, pp, m, TORCH_SCHEDULES[name][0])
        found[label] = simulate(schedule, costs).makespan
    return found
