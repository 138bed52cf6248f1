"""The statistics vector passed along one pipeline: partial sums forward, the full value back.

Stage s receives the partial vector from stage s-1, adds its own slots and passes it on; the
last stage holds the full vector and sends it back, each stage relaying it to the one before.
Every wait has the pipeline's P2P timeout and names the rank, the direction and the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.p2p import DEFAULT_TIMEOUT_S, wait_work
from .layout import StatsLayout

_PARTIAL, _FULL = 1, 2  # tags: the two directions never share a (source, destination) pair anyway


class StatsChain:
    def __init__(self, layout: StatsLayout, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.layout, self.device, self.timeout_s = layout, device, timeout_s
        self._sends: list[tuple[dist.Work, torch.Tensor, str]] = []
        self._full: tuple[dist.Work, torch.Tensor, str] | None = None

    def _peer(self, offset: int) -> int:
        return self.layout.chain_ranks[self.layout.stage + offset]

    def receive_partial(self, step: int) -> torch.Tensor:
        """The previous stages' statistics (zeros on the first stage)."""
        vector = torch.zeros(self.layout.size, dtype=torch.float, device=self.device)
        if self.layout.first:
            return vector
        work = dist.irecv(vector, self._peer(-1), group=self.layout.chain_group, tag=_PARTIAL)
        wait_work(work, self.timeout_s, self._describe("receiving the partial grad statistics of step", step, -1))
        return vector

    def send_partial(self, vector: torch.Tensor, step: int) -> None:
        if not self.layout.last:
            self._send(vector, _PARTIAL, +1, self._describe("sending the partial grad statistics of step", step, +1))

    def post_full(self, step: int) -> None:
        """Post the receive of the full vector from the next stage (not on the last stage)."""
        vector = torch.empty(self.layout.size, dtype=torch.float, device=self.device)
        work = dist.irecv(vector, self._peer(+1), group=self.layout.chain_group, tag=_FULL)
        self._full = (work, vector, self._describe("receiving the full grad statistics of step", step, +1))

    def wait_full(self) -> torch.Tensor:
        work, vector, description = self._full
        self._full = None
        wait_work(work, self.timeout_s, description)
        return vector

    def send_full(self, vector: torch.Tensor, step: int) -> None:
        """Relay the full vector to the previous stage (not on the first stage)."""
        if not self.layout.first:
            self._send(vector, _FULL, -1, self._describe("sending the full grad statistics of step", step, -1))

    def _send(self, vector: torch.Tensor, tag: int, offset: int, description: str) -> None:
        self.finish_sends()
        tensor = vector.clone()
        self._sends.append(
            (dist.isend(tensor, self._peer(offset), group=self.layout.chain_group, tag=tag), tensor, description)
        )

    def finish_sends(self) -> None:
        """Wait for the sends still in flight (each waits for the peer's matching receive)."""
        sends, self._sends = self._sends, []
        for work, _, description in sends:
            wait_work(work, self.timeout_s, description)

    def _describe(self, what: str, step: int, offset: int) -> str:
        peer = self.layout.stage + offset
        direction = "from" if what.startswith("receiving") else "to"
        return f"pipeline rank {self.layout.stage} {what} {step} {direction} pipeline rank {peer}"
