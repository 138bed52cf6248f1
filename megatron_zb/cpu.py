"""Shims that let megatron-core run on CPU with gloo, for tests and the CPU demo.

megatron-core assumes CUDA in a few places (``torch.cuda.current_device()`` as a device,
``device="cuda"`` tensors in the optimizer and the schedules, ``.cuda()`` copies,
``Tensor.type()`` checks, a CUDA RNG tracker, the MoE AlltoAll dispatcher's side stream).
``enable()`` maps all of them to the CPU.
It is applied only when asked, and refuses to run where CUDA is available. Every change is
recorded in ``megatron_zb.patching`` (scope ``cpu``), the function mode included, and
``disable()`` undoes it: torch and megatron-core are then as they were found.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from . import patching

_CPU = torch.device("cpu")
_lock = threading.Lock()
_mode = None  # the registry's entry for the function mode: in force while enabled


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU; every other call passes straight through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": _CPU}
            kwargs.pop("pin_memory", None)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and args[1:] and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _cuda_type_names(original):
    """``Tensor.type()`` answers with the CUDA names megatron-core's optimizers check for."""

    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _TYPE_NAMES:
            return _TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    return type_


def enable() -> None:
    """Make megatron-core usable on CPU in this process (idempotent). Never on a GPU machine.

    The function mode that maps CUDA devices to the CPU is entered on this thread (torch keeps a
    mode stack per thread), and ``disable()`` must run on it too.
    """
    global _mode
    if torch.cuda.is_available():
        raise RuntimeError("megatron_zb.cpu.enable() is for CPU-only runs; CUDA is available here")
    from megatron.core.tensor_parallel import random

    with _lock:
        if is_enabled():
            return
        cuda = torch.cuda
        patching.replace(cuda, "current_device", lambda: _CPU, patching.CPU)
        patching.replace(cuda, "synchronize", lambda *args, **kwargs: None, patching.CPU)
        patching.replace(cuda, "empty_cache", lambda: None, patching.CPU)
        # megatron-core 0.19's DDP start_grad_sync waits on the current stream's events: CPU's no-op stream.
        patching.replace(cuda, "current_stream", torch.cpu.current_stream, patching.CPU)
        patching.replace(torch.Tensor, "type", _cuda_type_names(torch.Tensor.type), patching.CPU)
        # Activation recomputation saves and restores the CUDA generator's state with the CPU's: none on CPU
        # (the CPU state, which CPU dropout draws from, is still saved and replayed).
        patching.replace(random, "_get_cuda_rng_state", _no_cuda_rng_state, patching.CPU)
        patching.replace(random, "_set_cuda_rng_state", _set_no_cuda_rng_state, patching.CPU)
        # The causal mask megatron-core builds with device="cuda" when no mask is given: the mode below maps it to
        # the CPU, but not where activation recomputation builds the forward again, inside autograd's backward.
        importlib.import_module("megatron.core.fusions.fused_softmax")
        utils = importlib.import_module("megatron.core.transformer.utils")
        patching.replace_everywhere(
            utils.get_default_causal_mask, _causal_mask, "get_default_causal_mask", patching.CPU
        )
        _moe()
        _mode = patching.enter_mode(_CudaToCpu(), patching.CPU)
        for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
            patching.remember(random, name, patching.CPU)  # reset below and on every model-parallel seed
    reset_rng_tracker()


def _moe() -> None:
    """What megatron-core's MoE layers need on top of the shims above (none of it changes the math).

    - The AlltoAll dispatcher creates one ``torch.cuda.Stream()`` for all its instances (a class
      attribute, made when still None) and copies token counts to the host on it: an inert stream
      is put there first, so CPU ops keep their program order.
    - It copies the all-to-all split sizes to the host as numpy arrays (``maybe_move_tensor_to_cpu(...,
      as_numpy=True)``), a no-op for tensors already on the CPU: ``all_to_all_single`` then gets tensors,
      which it refuses. They get the numpy arrays a GPU run gets.
    - 0.16.1's moe_utils binds ``te_general_gemm`` only when Transformer Engine imports (0.19 binds
      None otherwise), so the router's gating GEMM raises NameError without TE: None makes it take
      its torch.mm path, as 0.19 does. (A GPU run without TE on 0.16.1 hits the same.)

    The router's expert-bias and global-aux buffers (``device=torch.cuda.current_device()``) and
    ``gating()``'s move of CPU weights to that device are covered by ``current_device`` answering
    the CPU.
    """
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    alltoall = dispatcher.MoEAlltoAllTokenDispatcher
    if getattr(alltoall, "cuda_dtoh_stream", None) is None:
        patching.replace(alltoall, "cuda_dtoh_stream", InertStream(), patching.CPU)
    patching.hook(moe_utils, "maybe_move_tensor_to_cpu", _host_numpy, everywhere=True, scope=patching.CPU)
    if not hasattr(moe_utils, "te_general_gemm"):
        patching.replace(moe_utils, "te_general_gemm", None, patching.CPU)


def _host_numpy(original):
    def maybe_move_tensor_to_cpu(tensor, *args, **kwargs):
        as_numpy = kwargs.get("as_numpy", args[0] if args else False)
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, *args, **kwargs)

    return maybe_move_tensor_to_cpu


class InertStream:
    """A CUDA stream that orders nothing: every CPU op already runs in program order (``torch.cuda.stream()`` takes
    it); megatron_lm/cpu.py hands it out as torch.cuda's streams too."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else InertEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class InertEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def disable() -> None:
    """Undo ``enable()`` (and ``megatron_lm.cpu.enable()``, which builds on it): torch and megatron-core as found."""
    megatron_lm_cpu = sys.modules.get("megatron_zb.megatron_lm.cpu")  # a layer above: found, not imported
    if megatron_lm_cpu is not None:
        megatron_lm_cpu.disable_own()
    with _lock:
        patching.undo(patching.CPU)


def reset_rng_tracker() -> None:
    """Attention forks megatron's CUDA RNG tracker even without dropout; use the no-op one."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def is_enabled() -> bool:
    return _mode is not None and patching.in_force(_mode)
