"""megatron-core's torch-norm wrapper takes zero-centred weights and sequence parallelism once megatron-zb installs.

Without it, ``WrappedTorchNorm`` asserts on either (megatron-core's local layer spec, RMSNorm always, LayerNorm
without apex). With it, those settings build ``TorchNorm``: ``1 + weight`` for a zero-centred norm, weights marked
``sequence_parallel`` (megatron-core all-reduces their gradients); every other setting still gets torch's own norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_zb import patching
from megatron_zb.megatron import norms


def config(**fields) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **fields)


@pytest.fixture
def installed():
    norms.install()
    yield
    patching.undo()


def test_torch_norms_refuse_both_without_megatron_zb() -> None:
    megatron_cores = getattr(WrappedTorchNorm.__new__, "__wrapped__", WrappedTorchNorm.__new__)
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        megatron_cores(WrappedTorchNorm, config(layernorm_zero_centered_gamma=True), 8)
    with pytest.raises(AssertionError, match="sequence parallel"):
        megatron_cores(WrappedTorchNorm, config(sequence_parallel=True, tensor_model_parallel_size=2), 8)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norm_scales_by_one_plus_its_weight(installed, normalization: str) -> None:
    norm = WrappedTorchNorm(config(normalization=normalization, layernorm_zero_centered_gamma=True), 8, eps=1e-6)
    assert isinstance(norm, norms.TorchNorm) and torch.equal(norm.weight, torch.zeros(8))
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    if normalization == "RMSNorm":
        expected = F.rms_norm(x, (8,), norm.weight + 1, 1e-6)
    else:
        expected = F.layer_norm(x, (8,), norm.weight + 1, norm.bias, 1e-6)
    assert torch.equal(norm(x), expected)


def test_sequence_parallel_marks_the_weights_for_the_tensor_parallel_all_reduce(installed) -> None:
    norm = WrappedTorchNorm(config(sequence_parallel=True, tensor_model_parallel_size=2), 8)
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [True, True]


def test_other_settings_keep_torchs_own_norm(installed) -> None:
    assert type(WrappedTorchNorm(config(), 8)) is torch.nn.LayerNorm
    assert type(WrappedTorchNorm(config(normalization="RMSNorm"), 8)) is torch.nn.RMSNorm


def test_uninstall_puts_megatron_cores_wrapper_back(installed) -> None:
    patching.undo()
    with pytest.raises(AssertionError):
        WrappedTorchNorm(config(sequence_parallel=True, tensor_model_parallel_size=2), 8)
