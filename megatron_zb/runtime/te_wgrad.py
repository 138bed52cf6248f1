"""B/W split of Transformer Engine layers built with ``delay_wgrad_compute=True``.

Such a layer keeps (input, grad_output) of each backward in its own FIFO and computes the
weight gradient when ``backward_dw()`` is called. The W pass of (chunk, microbatch) calls it
on every such layer of the chunk; the FIFO means the Ws of a chunk must follow its Bs in
order, which the W queue checks. TE is imported nowhere here: layers are recognised by
their interface (``need_backward_dw()`` and ``backward_dw()``), so a stand-in with the same
interface exercises this path on CPU.
"""

from __future__ import annotations

import torch


def delayed_wgrad_layers(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``chunk`` that defer their weight gradient to ``backward_dw()``."""
    found = []
    for module in chunk.modules():
        need = getattr(module, "need_backward_dw", None)
        if callable(need) and callable(getattr(module, "backward_dw", None)) and need():
            found.append(module)
    return found


class BackwardDwJob:
    """W queue job: one ``backward_dw()`` per delayed layer of the chunk, for one microbatch."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.layers = layers

    def run(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Reverse layer order, as the gradients arrived in B; each call pops that layer's oldest entry.
        for layer in reversed(self.layers):
            layer.backward_dw()
        return []
