"""Settings the runtime refuses, with messages that say what would work; the CPU shims."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zb import cpu
from megatron_zb.runtime.megatron_contract import per_chunk_iterators, refuse_unsupported


def test_one_iterator_per_chunk():
    assert per_chunk_iterators("it", 1) == ["it"]
    with pytest.raises(ValueError, match="2 model chunks need a list of 2 data iterators"):
        per_chunk_iterators("it", 2)
    with pytest.raises(ValueError, match="got 3 data iterators for 2 model chunks"):
        per_chunk_iterators(["a", "b", "c"], 2)


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
        refuse_unsupported(config)
    refuse_unsupported(SimpleNamespace())  # nothing set: accepted


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


def test_forwards_out_of_microbatch_order_are_refused():
    from megatron_zb.runtime.executor import plan_rank
    from megatron_zb.schedule import Schedule, ScheduleError
    from megatron_zb.schedule.ir import parse_orders
    from megatron_zb.schedule.placement import linear

    orders = parse_orders("rank 0: F s0 mb1, F s0 mb0, BW s0 mb0, BW s0 mb1")
    with pytest.raises(ScheduleError, match="forwards of each stage in microbatch order"):
        plan_rank(Schedule("hand-made", (linear(1),), 2, orders), 0)
    in_order = parse_orders("rank 0: F s0 mb0, F s0 mb1, BW s0 mb1, BW s0 mb0")
    assert len(plan_rank(Schedule("hand-made", (linear(1),), 2, in_order), 0).passes) == 4
