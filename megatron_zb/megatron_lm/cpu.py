"""What Megatron-LM's ``pretrain()`` needs on top of ``megatron_zb.cpu`` to run on CPU with gloo.

``megatron_zb.cpu.enable()`` covers megatron-core; Megatron-LM's initialize and training loop
assume a GPU in a few more places, each shimmed here to what a CPU process would do:

- ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: it gets ``allow_no_cuda=True``.
- ``torch.cuda.device_count() == 0`` makes it skip ``initialize_model_parallel`` and the
  model-parallel seeds: it reads 1, ``set_device`` does nothing, and the model-parallel seed
  seeds the CPU generator and keeps megatron_zb.cpu's no-op RNG tracker (no CUDA generators).
- ``get_model`` builds DDP inside a side CUDA stream: streams and events are inert here.
- the fused softmax kernels are compiled with nvcc at start-up: the unfused path needs none.
- ``set_jit_fusion_options`` warms up the fused bias-GeLU/SwiGLU and bias-dropout-add by calling
  them, which on torch >= 2.2 compiles them with inductor: about 15 s of C++ compiling per process
  on CPU, before every run, for kernels a CPU line turns off (verify adds ``--no-bias-*-fusion``).
  The warm-up is skipped; a fusion a run does call still compiles at its first call.
- the dataset index helpers are compiled with whatever ``python3`` is on PATH: built with this
  interpreter and its pybind11 instead (when the checkout's megatron.core has none built).
- checkpoints save and restore the CUDA RNG state: an empty state, restored as a no-op.
- memory reports read CUDA allocator statistics: zeros.
- ``validate_args`` reads the GPU's architecture (``get_device_arch_version``) when tensor
  parallelism is on: architecture 0 (no GPU), so it asks for ``CUDA_DEVICE_MAX_CONNECTIONS=1``
  as on a pre-Blackwell GPU; the CPU launcher sets it.

``enable()`` is idempotent and, like ``megatron_zb.cpu.enable()``, refuses a machine with CUDA. Every
change is recorded in ``megatron_zb.patching`` (scope ``megatron-lm-cpu``); ``disable()`` undoes
it and ``megatron_zb.cpu``'s shims: torch, megatron-core and Megatron-LM are then as they were found.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import subprocess
import sys
import sysconfig
import threading

import torch

from .. import patching
from ..cpu import InertEvent, InertStream

_lock = threading.Lock()
_SCOPE = patching.MEGATRON_LM_CPU
_first = None  # enable()'s first entry: in force while enabled (no_gpu_architecture() alone records too)
# The one state the no-op RNG tracker reports on CPU (it forks nothing; see _cpu_model_parallel_seed).
CPU_TRACKER_STATE = "megatron-zb-cpu-no-op"


_DEFAULT_STREAM = InertStream()


def enable() -> None:
    """Let Megatron-LM's initialize and training loop run on CPU in this process (idempotent)."""
    global _first
    from .. import cpu

    cpu.enable()
    with _lock:
        if is_enabled():
            return
        _first = _torch_cuda()
        _megatron_lm()


def disable() -> None:
    """Undo ``enable()``, ``megatron_zb.cpu``'s shims included."""
    from .. import cpu

    cpu.disable()  # undoes this module's scope first


def disable_own() -> None:
    """Undo this module's changes only (``megatron_zb.cpu.disable()`` calls it before undoing its own)."""
    with _lock:
        patching.undo(_SCOPE)


def _torch_cuda() -> patching.Patch:
    shims = {
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "Stream": InertStream,
        "Event": InertEvent,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "set_stream": lambda stream: None,
        "get_rng_state": lambda device=None: torch.empty(0, dtype=torch.uint8),
        "set_rng_state": lambda state, device=None: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "memory_stats": lambda device=None: _ZeroStats(),
        "reset_peak_memory_stats": lambda device=None: None,
    }
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        shims[name] = lambda device=None: 0
    patches = [patching.replace(torch.cuda, name, shim, _SCOPE) for name, shim in shims.items()]
    return patches[0]


class _ZeroStats(dict):
    def __missing__(self, key):
        return 0


def _megatron_lm() -> None:
    from megatron.core import tensor_parallel

    original = tensor_parallel.model_parallel_cuda_manual_seed
    seed = _cpu_model_parallel_seed(original)
    owners = [tensor_parallel]
    with contextlib.suppress(ImportError):
        from megatron.core.tensor_parallel import random

        owners.append(random)
    initialize = importlib.import_module("megatron.training.initialize")
    owners.append(initialize)  # it calls the name it bound, where it bound one
    for owner in owners:
        if getattr(owner, "model_parallel_cuda_manual_seed", None) is original:
            patching.replace(owner, "model_parallel_cuda_manual_seed", seed, _SCOPE)
    from megatron.core.datasets import utils as dataset_utils

    patching.replace(dataset_utils, "compile_helpers", compile_dataset_helpers, _SCOPE)
    for module in (initialize, importlib.import_module("megatron.training.training")):
        original = getattr(module, "initialize_megatron", None)
        if original is not None and not getattr(original, "megatron_zb_cpu", False):
            patching.replace(module, "initialize_megatron", _without_cuda(original), _SCOPE)
    if hasattr(initialize, "_warmup_jit_function"):
        patching.replace(initialize, "_warmup_jit_function", _no_warmup, _SCOPE)
    no_gpu_architecture()
    with contextlib.suppress(ImportError):
        from megatron.legacy import fused_kernels

        patching.replace(fused_kernels, "load", lambda args: None, _SCOPE)


def set_environment() -> None:
    """What Megatron-LM's validate_args asks of the environment with tensor parallelism below Blackwell, without
    Transformer Engine's attention variables (``TE_ATTENTION_VARIABLES``).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` orders kernels on a GPU; on CPU it has no meaning, but without it
    validate_args refuses tensor or context parallelism (architecture 0 here, see ``no_gpu_architecture``).
    """
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for name in TE_ATTENTION_VARIABLES:
        os.environ.pop(name, None)


# Transformer Engine's choice of attention kernel. A CPU run has no Transformer Engine, but megatron-core's
# language model still checks them against --attention-backend (auto: each must be unset or 1), so a line's
# NVTE_FUSED_ATTN=0 would stop every rank.
TE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def te_attention_settings() -> list[str]:
    """The Transformer Engine attention variables set in this environment (``set_environment`` unsets them)."""
    return [f"{name}={os.environ[name]}" for name in TE_ATTENTION_VARIABLES if name in os.environ]


def no_gpu_architecture() -> None:
    """Megatron-LM's ``get_device_arch_version()`` (utils, bound in arguments) answers 0: no GPU here.

    Recorded under ``megatron-lm-cpu`` (the launcher's preflight calls it alone): ``disable()`` undoes it.
    """
    utils = importlib.import_module("megatron.training.utils")
    original = getattr(utils, "get_device_arch_version", None)
    if original is None:
        return
    patching.replace_everywhere(original, _architecture_0, "get_device_arch_version", _SCOPE)


def _architecture_0() -> int:
    return 0


def _no_warmup(*args, **kwargs) -> None:
    """Megatron-LM's ``_warmup_jit_function`` on CPU: nothing to warm (see the module's docstring)."""


def _without_cuda(initialize_megatron):
    """``initialize_megatron`` with ``allow_no_cuda=True``: its CUDA assert is the only thing that flag changes."""
    if getattr(initialize_megatron, "megatron_zb_cpu", False):
        return initialize_megatron

    @functools.wraps(initialize_megatron)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize.megatron_zb_cpu = True
    return initialize


def _cpu_model_parallel_seed(original):
    if getattr(original, "megatron_zb_cpu", False):
        return original

    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs) -> None:
        from megatron.core import tensor_parallel

        from .. import cpu

        cpu.reset_rng_tracker()
        # Megatron-LM's load_checkpoint takes empty tracker states for a damaged checkpoint and exits
        # (sys.exit(), status 0) without loading: the no-op tracker saves one placeholder state instead.
        tracker = tensor_parallel.get_cuda_rng_tracker()
        patching.replace(tracker, "get_states", lambda: {CPU_TRACKER_STATE: torch.empty(0, dtype=torch.uint8)}, _SCOPE)

    model_parallel_cuda_manual_seed.megatron_zb_cpu = True
    return model_parallel_cuda_manual_seed


def compile_dataset_helpers() -> None:
    """Build megatron-core's dataset index helpers for this interpreter, unless they import already."""
    with contextlib.suppress(ImportError):
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    from megatron.core import datasets

    folder = os.path.dirname(os.path.abspath(datasets.__file__))
    try:
        includes = subprocess.run(
            [sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except subprocess.CalledProcessError:
        raise SystemExit(
            "megatron-zb: building megatron-core's dataset helpers needs the package pybind11 "
            "(pip install 'megatron-zb[megatron-lm]')"
        ) from None
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    done = subprocess.run(
        ["make", "-C", folder, f"CPPFLAGS={includes}", f"LIBEXT={suffix}"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(
            f"megatron-zb: building megatron-core's dataset helpers in {folder} failed (needs make and a C++ "
            f"compiler):\n{done.stdout}{done.stderr}"
        )


def is_enabled() -> bool:
    return _first is not None and patching.in_force(_first)
