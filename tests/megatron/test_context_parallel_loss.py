"""The loss megatron-zb's runtime backpropagates with context parallelism equals megatron-core's forward_step's.

megatron-core scales a legacy (loss, dict) loss and the MoE auxiliary loss by the context-parallel size (each
CP rank holds a slice of the sequence; the gradient all-reduce over data x context parallel ranks averages it
back). megatron-zb's schedules refuse CP > 1 (no CP run through them has been checked on GPUs); this pins the
part that is theirs, so that lifting the refusal does not start from a wrong scale. No process group: both
functions take the CP size as a number.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zb.runtime import steps

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def config(per_token: bool, moe: bool) -> SimpleNamespace:
    return SimpleNamespace(
        calculate_per_token_loss=per_token,
        num_moe_experts=4 if moe else None,
        mtp_num_layers=None,
        grad_scale_func=lambda loss: loss * 8.0,
        timers=None,
        experimental_attention_variant=None,
        moe_grad_scale_func=None,
        mtp_grad_scale_func=None,
    )


def legacy(output: torch.Tensor):
    return output.sum(), {"lm loss": output.sum().detach()}


def with_tokens(output: torch.Tensor):
    return output.sum(), torch.tensor(5), {"lm loss": output.sum().detach()}


def moe_scale() -> float:
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    return float(MoEAuxLossAutoScaler.main_loss_backward_scale)


@pytest.mark.parametrize("loss_func", [legacy, with_tokens])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_loss_and_moe_scale_equal_megatron_cores_at_each_context_parallel_size(loss_func, per_token: bool, cp: int):
    output = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1
    expected_store: list = []
    expected, _ = schedules.forward_step_calc_loss(
        None, output.clone(), loss_func, config(per_token, True), None, False, 3, expected_store,
        cp_group_size=cp, is_last_stage=True,
    )  # fmt: skip
    expected_moe = moe_scale()
    ctx = steps.ForwardContext(None, [None], [None], 3, config(per_token, True), cp_size=cp)
    found = steps._loss(ctx, output.clone(), loss_func)
    assert float(found) == float(expected)
    assert moe_scale() == expected_moe
    assert ctx.forward_data_store == expected_store
    if loss_func is legacy and not per_token:  # the CP size is in it: 21 x cp / 3 microbatches
        assert float(found) == 21.0 * cp / 3
    if not per_token:  # the grad scale 8 x cp / 3 microbatches
        assert moe_scale() == pytest.approx(8.0 * cp / 3)
