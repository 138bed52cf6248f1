"""Mock data: learnable token sequences, addressed by global sample index.

Sample ``i`` is an arithmetic sequence modulo the vocabulary whose start and stride come from
(seed, i), so a small GPT learns it within a few dozen iterations and the loss visibly falls.
Indexing by sample, as Megatron's pretraining sampler does, makes every data-parallel rank
read its own slice and a resumed run continue with exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

STRIDES = (1, 2, 3, 5)


@dataclass(frozen=True)
class MockData:
    vocab: int
    seq: int
    micro_batch: int
    global_batch: int
    dp_size: int
    dp_rank: int
    seed: int

    def sample(self, index: int) -> torch.Tensor:
        """``seq + 1`` tokens of sample ``index``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab, (1,), generator=generator))
        stride = STRIDES[int(torch.randint(0, len(STRIDES), (1,), generator=generator))]
        return (start + stride * torch.arange(self.seq + 1)) % self.vocab

    def microbatch(self, iteration: int, microbatch: int) -> dict[str, torch.Tensor]:
        """Microbatch ``microbatch`` of (1-based) ``iteration`` for this data-parallel rank."""
        first = (iteration - 1) * self.global_batch + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch
        tokens = torch.stack([self.sample(first + row) for row in range(self.micro_batch)])
        return {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(self.micro_batch, self.seq),
            "position_ids": torch.arange(self.seq).expand(self.micro_batch, self.seq).contiguous(),
        }

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def iterator(self, iteration: int, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
        """The microbatches of one iteration, in order (one such iterator per model chunk)."""
        for microbatch in range(self.microbatches):
            yield {key: value.to(device) for key, value in self.microbatch(iteration, microbatch).items()}
