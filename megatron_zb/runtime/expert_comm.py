"""The time megatron-core's expert-parallel all-to-all takes inside the passes that run it (T_a2a).

megatron-core's token dispatchers run their communication synchronously inside the MoE layer,
through three functions of ``megatron.core.tensor_parallel`` that ``token_dispatcher.py`` binds
by name: ``all_to_all`` (the AlltoAll dispatcher's tokens and probs, dispatch and combine),
``gather_from_sequence_parallel_region`` (the AllGather dispatcher's dispatch; the AlltoAll
dispatcher's token counts and, with expert TP, its tokens) and
``reduce_scatter_to_sequence_parallel_region`` (the AllGather dispatcher's combine; AlltoAll with
expert TP). ``install`` wraps those names in the dispatcher's module only, so tensor parallelism's
own calls elsewhere are not counted; the wrappers are recorded in ``patching`` (scope ``megatron``,
undone by ``megatron_zb.uninstall()`` too).

While a ``Meter`` is active (the profiler runs each pass in one) a wrapped call adds its time to
it, and marks its input and output so that its backward, whenever autograd runs it (in B, inside
that pass's meter), adds its time there. With no meter active the wrappers call straight through.
Times come from the meter's clock (the profiler's, which synchronises a GPU).

The active meters are the process's (a GPU's backward runs on autograd's own thread), except on
the two sides of an overlapped pair (``own_thread``): each keeps its own, so that each side's
all-to-all is booked to its own pass; a thread with none of its own (autograd's, running the
backward side's backward) books to the backward side's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
WRAPPED = ("all_to_all", "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region")

_lock = threading.Lock()
_meters: list[Meter] = []  # active, innermost last; not per thread: a GPU's backward runs on autograd's thread
_threads = threading.local()  # .meters: a pair side's own active meters (``own_thread``)
_backward_side: list[Meter] | None = None  # the backward side's, for threads with none of their own


class Meter:
    """Seconds of expert-parallel communication seen while active."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0


@contextmanager
def metering(clock: Callable[[], float]) -> Iterator[Meter]:
    """A meter active for the ``with`` block (meters nest: every active one counts a call)."""
    install()
    meter, meters = Meter(clock), _here()
    with _lock:
        meters.append(meter)
    try:
        yield meter
    finally:
        with _lock:
            meters.remove(meter)


@contextmanager
def own_thread(backward: bool) -> Iterator[None]:
    """This thread keeps its own active meters (starting with those active now: an outer meter counts both sides)
    for the ``with`` block; ``backward``: other threads (autograd's) book to these."""
    global _backward_side
    if hasattr(_threads, "meters"):
        raise RuntimeError("this thread already keeps its own all-to-all meters (an overlapped pair inside a pair)")
    with _lock:
        _threads.meters = list(_here())
        if backward:
            _backward_side = _threads.meters
    try:
        yield
    finally:
        with _lock:
            if backward:
                _backward_side = None
            del _threads.meters


def _here() -> list[Meter]:
    """The meters a call on this thread counts in (see the module)."""
    own = getattr(_threads, "meters", None)
    if own is not None:
        return own
    return _backward_side if _backward_side is not None else _meters


def install() -> bool:
    """Wrap the dispatcher's communication functions (idempotent); False when no MoE dispatcher is loaded."""
    module = sys.modules.get(DISPATCHER)
    if module is None:
        return False
    from .. import patching

    for name in WRAPPED:
        patching.hook(module, name, _timed)
    return True


def _add(seconds: float, meters: list[Meter]) -> None:
    with _lock:
        for meter in meters:
            meter.seconds += seconds
            meter.calls += 1


class _Call:
    """One wrapped call's backward: started when its output's gradient arrives, ended at its input's."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.clock: Callable[[], float] | None = None

    def start(self) -> None:
        meters = _here()
        if meters:
            self.clock = meters[-1].clock
            self.started = self.clock()

    def end(self) -> None:
        meters = _here()
        if self.started is not None and self.clock is not None and meters:
            _add(self.clock() - self.started, meters)
        self.started = None


class _Mark(torch.autograd.Function):
    """Identity whose backward starts or ends a call's backward timing: on the call's output it runs right
    before the call's own backward (``_Call.start``), on its input right after (``_Call.end``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, at: Callable[[], None]) -> torch.Tensor:
        ctx.at = at
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.at()
        return grad, None


def _timed(original: Callable) -> Callable:
    def timed(*args, **kwargs):
        meters = _here()
        if not meters:
            return original(*args, **kwargs)
        clock = meters[-1].clock
        call = None
        if torch.is_grad_enabled():
            args, kwargs, call = _mark_input(args, kwargs)
        start = clock()
        output = original(*args, **kwargs)
        _add(clock() - start, meters)
        if call is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            output = _Mark.apply(output, call.start)
        return output

    return timed


def _mark_input(args: tuple, kwargs: dict) -> tuple[tuple, dict, _Call | None]:
    """The call's arguments with its input tensor (the first tensor given) marked, if it needs a gradient."""
    call = _Call()
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            if not value.requires_grad:
                return args, kwargs, None
            return (*args[:index], _Mark.apply(value, call.end), *args[index + 1 :]), kwargs, call
    value = kwargs.get("input_")
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return args, {**kwargs, "input_": _Mark.apply(value, call.end)}, call
    return args, kwargs, None
