"""One forward and one backward of a model chunk, as megatron-core's schedules run them.

Our own code rather than megatron-core's ``forward_step``/``backward_step``: their
signatures change between releases, and B must run the autograd engine directly (sent
outputs are freed to one element, which ``torch.autograd.backward`` would reject).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.autograd.variable import Variable

from ..compat import attention_variant_loss_scale_func


@dataclass
class ForwardContext:
    """What every forward of one ``forward_backward`` call shares."""

    forward_step_func: object
    data_iterators: list
    models: list[torch.nn.Module]
    num_microbatches: int
    config: object
    cp_size: int = 1
    collect_non_loss_data: bool = False
    forward_data_store: list = field(default_factory=list)
    num_tokens: torch.Tensor | None = None
    mark_first_microbatch: bool = True  # False on validation steps after the first (TE fp8 weight caching)
    # chunks whose forwards run only some of the microbatches (BitPipe's pipes share the batch): their
    # data iterators skip the batches of the others, so microbatch k reads the k-th batch as everywhere else
    partial_chunks: frozenset[int] = frozenset()
    _read: dict[int, int] = field(default_factory=dict)  # chunk -> batches its iterator gave this iteration

    def restart(self) -> None:
        """Start the iteration over: no losses kept, the data iterators read from their first item again."""
        self.forward_data_store.clear()
        self.num_tokens = None
        self._read.clear()
        for iterator in self.data_iterators:
            if hasattr(iterator, "rewind"):
                iterator.rewind()

    def align(self, chunk: int, microbatch: int) -> None:
        """Before ``chunk`` reads microbatch ``microbatch``: skip the batches of the microbatches it does not run."""
        if chunk not in self.partial_chunks:
            return
        self._skip(chunk, microbatch - self._read.get(chunk, 0))
        self._read[chunk] = microbatch + 1

    def finish_reading(self) -> None:
        """At the end of the iteration: every partial chunk's iterator has passed all the iteration's batches."""
        for chunk in self.partial_chunks:
            self._skip(chunk, self.num_microbatches - self._read.get(chunk, 0))
        self._read.clear()

    def _skip(self, chunk: int, count: int) -> None:
        iterator = self.data_iterators[chunk]
        if iterator is None:
            return
        for _ in range(count):
            next(iterator)


def unwrap(model: torch.nn.Module, attribute: str):
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, attribute)


def forward(
    ctx: ForwardContext, chunk: int, microbatch: int, input_tensor: torch.Tensor | None, loss_stage: bool, first: bool
) -> torch.Tensor:
    """Run ``forward_step_func`` on ``chunk``; on the loss stage return the scaled loss."""
    model, config = ctx.models[chunk], ctx.config
    if first and ctx.mark_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    _set_current_microbatch(model, microbatch)
    set_input_tensor = unwrap(model, "set_input_tensor")
    set_input_tensor([input_tensor])
    ctx.align(chunk, microbatch)
    autocast = (
        torch.autocast("cuda", dtype=config.autocast_dtype)
        if getattr(config, "enable_autocast", False)
        else contextlib.nullcontext()
    )
    with autocast:
        output, loss_func = ctx.forward_step_func(ctx.data_iterators[chunk], model)
    set_input_tensor([None])  # the model would otherwise keep the last input alive past the iteration
    if loss_stage:
        output = _loss(ctx, output, loss_func)
    else:  # megatron-core sets the auxiliary losses' scale after every forward, on every stage
        _scale_auxiliary_losses(ctx.config, output, ctx.cp_size, ctx.num_microbatches)
    return output


def _loss(ctx: ForwardContext, output, loss_func):
    """megatron-core's loss convention: divide by tokens then microbatches, or legacy (loss, dict)."""
    config, m = ctx.config, ctx.num_microbatches
    if loss_func is None:
        ctx.forward_data_store.append(output)
        return output
    if ctx.collect_non_loss_data:
        ctx.forward_data_store.append(loss_func(output, non_loss_data=True))
        return output
    outputs = loss_func(output)
    if len(outputs) == 3:
        loss, num_tokens, reduced = outputs
        if not config.calculate_per_token_loss:
            loss = loss / torch.clamp(num_tokens, min=1) / m
        ctx.num_tokens = num_tokens if ctx.num_tokens is None else ctx.num_tokens + num_tokens
    else:
        loss, reduced = outputs
        loss = loss * ctx.cp_size / m
    ctx.forward_data_store.append(reduced)
    _scale_auxiliary_losses(config, loss, ctx.cp_size, m)
    return loss


def _scale_auxiliary_losses(config, loss: torch.Tensor, cp_size: int, m: int) -> None:
    """MoE auxiliary, MTP and attention-variant losses backpropagate through autoscalers that need the loss scale.

    As megatron-core's ``forward_step_calc_loss``: 0.19 takes the MoE and MTP scales from
    ``moe_grad_scale_func`` / ``mtp_grad_scale_func`` when set (else ``grad_scale_func``) and also
    scales an attention variant's auxiliary loss (DSA's indexer loss).
    """
    moe = getattr(config, "num_moe_experts", None) is not None
    mtp = getattr(config, "mtp_num_layers", None) is not None
    variant = attention_variant_loss_scale_func(config)
    if not (moe or mtp or variant):
        return
    per_token, device = config.calculate_per_token_loss, loss.device
    if moe:
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        scale = _loss_scale(config, device, "moe_grad_scale_func")
        MoEAuxLossAutoScaler.set_loss_scale(scale if per_token else scale * cp_size / m)
    if mtp:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        scale = _loss_scale(config, device, "mtp_grad_scale_func")
        MTPLossAutoScaler.set_loss_scale(scale if per_token else scale / m)
    if variant is not None:
        scale = _loss_scale(config, device)
        variant(scale if per_token else scale * cp_size / m)


def _loss_scale(config, device: torch.device, hook: str | None = None) -> torch.Tensor:
    """The scale of an auxiliary loss: ``config.<hook>()`` when set (0.19), else ``grad_scale_func`` of one."""
    scale_func = getattr(config, hook, None) if hook is not None else None
    if scale_func is not None:
        scale, name = scale_func(), hook
    elif config.grad_scale_func is not None:
        scale, name = config.grad_scale_func(torch.ones(1, device=device)), "grad_scale_func"
    else:
        return torch.ones(1, device=device)
    scale = torch.as_tensor(scale, device=device)
    if scale.numel() != 1:
        raise ValueError(f"config.{name} must return a scalar or a size-1 tensor; it returned {scale.numel()} elements")
    return scale


def _set_current_microbatch(model: torch.nn.Module, microbatch: int) -> None:
    try:
        from megatron.core.pipeline_parallel.schedules import set_current_microbatch
    except ImportError:
        return
    set_current_microbatch(model, microbatch)


def backward(
    output: torch.Tensor, output_grad: torch.Tensor | None, input_tensor: torch.Tensor | None, config
) -> torch.Tensor | None:
    """Backpropagate from ``output`` (the loss when ``output_grad`` is None); return the input gradient."""
    if output_grad is None and config.grad_scale_func is not None:
        output = config.grad_scale_func(output)
    if output.requires_grad:
        if output_grad is None:
            output_grad = torch.ones_like(output, memory_format=torch.preserve_format)
        Variable._execution_engine.run_backward(
            tensors=(output,),
            grad_tensors=(output_grad,),
            keep_graph=False,
            create_graph=False,
            inputs=(),
            allow_unreachable=True,
            accumulate_grad=True,
        )
    return None if input_tensor is None else input_tensor.grad
