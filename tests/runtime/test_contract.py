"""Settings the runtime refuses, with messages that say what would work; the CPU shims."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zb import cpu
from megatron_zb.runtime.forward_backward import _per_chunk_iterators, _refuse_unsupported


def test_one_iterator_per_chunk():
    assert _per_chunk_iterators("it", 1) == ["it"]
    with pytest.raises(ValueError, match="2 model chunks need a list of 2 data iterators"):
        _per_chunk_iterators("it", 2)
    with pytest.raises(ValueError, match="got 3 data iterators for 2 model chunks"):
        _per_chunk_iterators(["a", "b", "c"], 2)


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"variable_seq_lengths": True}, "variable sequence lengths"),
        ({"defer_embedding_wgrad_compute": True}, "defer-embedding-wgrad-compute"),
        ({"num_microbatches_with_partial_activation_checkpoints": 2}, "partial-activation-checkpoints"),
    ],
)
def test_unsupported_config_is_refused(setting, message):
    config = SimpleNamespace(**setting)
    with pytest.raises(ValueError, match=message):
        _refuse_unsupported(config)
    _refuse_unsupported(SimpleNamespace())  # nothing set: accepted


def test_cpu_shims_refuse_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CPU-only"):
        cpu.enable()


def test_cpu_shims_map_cuda_to_cpu():
    cpu.enable()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    tensor = torch.ones(3)
    assert tensor.cuda() is tensor
    assert tensor.type() == "torch.cuda.FloatTensor"
    assert tensor.type(torch.float64).dtype == torch.float64  # with arguments: torch's own behaviour
