"""B/W split of megatron-core's ColumnParallelLinear and RowParallelLinear.

Both call the module-level ``linear_with_grad_accumulation_and_async_allreduce`` of
``megatron.core.tensor_parallel.layers`` at call time, so replacing that one function covers
qkv, proj, fc1, fc2 and the output layer, and in MoE layers the fc1 and fc2 of every local
expert (SequentialMLP) and of the shared expert. Expert linears (``explicit_expert_comm``) pass
``allreduce_dgrad=False`` and ``sequence_parallel=False``: the dispatcher does their
communication, so B and W here only multiply. Inside our executor the replacement runs a linear
whose backward computes the input gradient (with the TP all-reduce, or the reduce-scatter
under sequence parallelism) and queues the weight-gradient GEMM in the W queue. Outside it,
megatron-core's own function runs unchanged.

The weight enters the autograd function detached: were the Parameter an input, its
AccumulateGrad hook (DDP's) would fire in B with no gradient.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..compat import argument_binder
from .wgrad import accumulate, active_store

_lock = threading.Lock()
_patch = None  # the registry's entry (scope ``megatron``: megatron_zb.uninstall() undoes it too)
_original = None
_bind = None  # the original's arguments by name, for whichever version is loaded


def install() -> None:
    """Patch megatron-core's linear function (idempotent; again after an undo), recorded in ``patching``."""
    global _patch, _original, _bind
    from megatron.core.tensor_parallel import layers

    from .. import patching

    with _lock:
        if _patch is not None and patching.in_force(_patch):
            return
        original = layers.linear_with_grad_accumulation_and_async_allreduce
        if original is splittable_linear:
            return  # ours already (put back by someone's undo that ran out of order): keep the original we hold
        _original, _bind = original, argument_binder(original)
        _patch = patching.replace(
            layers, "linear_with_grad_accumulation_and_async_allreduce", splittable_linear, patching.MEGATRON
        )


def uninstall() -> None:
    """Put megatron-core's function back (``megatron_zb.uninstall()`` does it too)."""
    global _patch
    from .. import patching

    with _lock:
        if _patch is not None:
            patching.revert(_patch)
            _patch = None


def splittable_linear(*args, **kwargs) -> torch.Tensor:
    """Drop-in for megatron-core's function: splittable inside our executor, the original outside.

    Takes whatever the patched version's signature takes (0.17 dropped ``async_grad_allreduce``,
    0.19 added ``gtp_remat_size``): arguments are bound against the original, and the call is
    passed on untouched wherever megatron-core's own function runs.
    """
    if active_store() is None:
        return _original(*args, **kwargs)  # outside our passes: leave it to megatron
    call = _bind(args, kwargs)
    if call.get("grad_output_buffer") is not None:
        return _original(*args, **kwargs)  # megatron's own deferred embedding wgrad
    if (call.get("gtp_remat_size") or 1) > 1:
        raise NotImplementedError(
            f"megatron-zb schedules do not split linears with GTP-sharded weights (gtp_remat_size="
            f"{call['gtp_remat_size']}); run without the gtp_remat process group"
        )
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    input, weight, bias = call["input"], call["weight"], call["bias"]
    tp_group = call.get("tp_group")
    tp_group = tp_group if tp_group is not None else get_tensor_model_parallel_group()
    options = _Options(
        weight, call["gradient_accumulation_fusion"], call["allreduce_dgrad"], call["sequence_parallel"], tp_group
    )
    options.store = active_store()
    anchor = _anchor(input, bias)
    return _SplitLinear.apply(input, weight.detach(), bias, anchor, options)


# megatron-core's function reads and sets this attribute on whatever its module name holds.
splittable_linear.warned = False


class _Options:
    """Non-tensor arguments; holding the Parameter here keeps it out of the autograd inputs."""

    def __init__(self, weight, fusion, allreduce_dgrad, sequence_parallel, tp_group):
        self.weight = weight
        self.fusion = fusion
        self.allreduce_dgrad = allreduce_dgrad
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        self.store = None


def _anchor(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf that makes autograd call our backward even when nothing else needs a gradient."""
    if input.requires_grad or (bias is not None and bias.requires_grad):
        return None
    return torch.empty(0, device=input.device, requires_grad=True)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, anchor, options):
        total_input = _gather(input, options.tp_group) if options.sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(input, weight)
        ctx.options = options
        ctx.use_bias = bias is not None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        options = ctx.options
        grad_input = grad_output.matmul(weight)
        if options.sequence_parallel:
            grad_input = _reduce_scatter(grad_input, options.tp_group)
        elif options.allreduce_dgrad:
            dist.all_reduce(grad_input, group=options.tp_group)
        job = LinearWeightGrad(options, input, grad_output)
        store = options.store  # captured in forward: backward may run on autograd's device thread
        if store is None or not store.defer(job):
            params_grads = job.run()
            if params_grads:
                accumulate(*map(list, zip(*params_grads, strict=True)))
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_bias, None, None


class LinearWeightGrad:
    """The weight-gradient GEMM of one linear for one microbatch (a W queue job)."""

    def __init__(self, options: _Options, input: torch.Tensor, grad_output: torch.Tensor):
        self.options = options
        self.input = input
        self.grad_output = grad_output

    def run(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        options, weight = self.options, self.options.weight
        total_input = _gather(self.input, options.tp_group) if options.sequence_parallel else self.input
        grad_output = self.grad_output.contiguous()
        grad_output = grad_output.view(-1, grad_output.shape[-1])
        total_input = total_input.contiguous()
        total_input = total_input.view(-1, total_input.shape[-1])
        self.input = self.grad_output = None
        if options.fusion and hasattr(weight, "main_grad"):
            _accumulate_into_main_grad(weight.main_grad, grad_output, total_input)
            if not hasattr(weight, "grad_added_to_main_grad"):
                return []
            weight.grad_added_to_main_grad = True
            # As megatron-core: a placeholder gradient so DDP's hook runs and marks the
            # parameter ready without adding anything.
            fill = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            return [(weight, fill(weight.main_grad.shape, dtype=total_input.dtype, device=total_input.device))]
        return [(weight, grad_output.t().matmul(total_input))]


def _accumulate_into_main_grad(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    try:
        import fused_weight_gradient_mlp_cuda
    except ImportError:
        fused_weight_gradient_mlp_cuda = None
    if fused_weight_gradient_mlp_cuda is not None and main_grad.is_cuda:
        if main_grad.dtype == torch.float32:
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
        else:
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
        return
    main_grad.add_(grad_output.t().matmul(total_input).to(main_grad.dtype))


@torch.no_grad()
def _gather(input: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along the sequence dimension (sequence parallelism).

    Without grad mode: a W job runs with it on, and gloo writes into views of ``output`` that it
    makes without, which autograd refuses.
    """
    size = list(input.shape)
    size[0] *= group.size()
    output = torch.empty(size, dtype=input.dtype, device=input.device)
    dist.all_gather_into_tensor(output, input.contiguous(), group=group)
    return output


@torch.no_grad()
def _reduce_scatter(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = list(grad.shape)
    size[0] //= group.size()
    output = torch.empty(size, dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_tensor(output, grad.contiguous(), group=group)
    return output
