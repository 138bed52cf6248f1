"""megatron-core's torch norms with what torch's own lack: zero-centred gamma and sequence parallelism.

megatron-core's local layer spec builds ``WrappedTorchNorm`` for RMSNorm always, and for LayerNorm
without apex (every CPU run). It returns torch's ``LayerNorm``/``RMSNorm`` and asserts that neither
``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``) nor ``--sequence-parallel`` is set. Both
are common in real settings (Llama-style lines carry both), so ``install()`` (part of
``megatron_zb.install()``, recorded in ``patching``) lets ``WrappedTorchNorm`` build ``TorchNorm`` for
them, on any device:

- zero-centred gamma: the weight starts at 0 and the norm scales by ``1 + weight``, as TE's and
  apex's ``zero_centered_gamma`` do;
- sequence parallelism: the norm runs on this rank's slice of the sequence (nothing to change) and
  marks its parameters ``sequence_parallel``, so that megatron-core all-reduces their gradients
  over the tensor-parallel group (``finalize_model_grads``), as apex's and TE's norms do.

Every other setting still gets torch's own norm, so runs without these flags are unchanged. Transformer
Engine's and apex's norms (which have both) are not touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import patching


class TorchNorm(torch.nn.Module):
    """LayerNorm or RMSNorm over the last dimension, optionally zero-centred, marked for sequence parallelism."""

    def __init__(self, hidden_size: int, eps: float, normalization: str, zero_centered: bool, sequence_parallel: bool):
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {normalization!r}: TorchNorm implements LayerNorm and RMSNorm")
        self.shape, self.eps, self.normalization = (hidden_size,), eps, normalization
        self.zero_centered = zero_centered
        start = torch.zeros if zero_centered else torch.ones
        self.weight = torch.nn.Parameter(start(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if normalization == "LayerNorm" else None
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, self.bias, self.eps)


def _needs_our_norm(config) -> bool:
    return bool(config.layernorm_zero_centered_gamma or config.sequence_parallel)


def _wrapped_norm(original_new):
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, *args, **kwargs):
        if not _needs_our_norm(config) or config.persist_layer_norm or config.memory_efficient_layer_norm:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        return TorchNorm(
            hidden_size, eps, config.normalization, config.layernorm_zero_centered_gamma, config.sequence_parallel
        )

    return __new__


def install() -> None:
    """Let megatron-core's ``WrappedTorchNorm`` build ``TorchNorm`` where torch's norms would assert (recorded)."""
    from megatron.core.transformer import torch_norm

    patching.hook(torch_norm.WrappedTorchNorm, "__new__", _wrapped_norm)
