"""Data-parallel backends driven by the planned UNSHARD / RESHARD / REDUCE_GRAD actions (contract: base.py)."""

from .backend import backend_for
from .base import DataParallelBackend, DataParallelPlanError, Handle, Ready
from .fsdp2 import FSDP2Backend, missing_fsdp2_features
from .megatron_ddp import MegatronDDPBackend

__all__ = [
    "DataParallelBackend",
    "DataParallelPlanError",
    "FSDP2Backend",
    "Handle",
    "MegatronDDPBackend",
    "Ready",
    "backend_for",
    "missing_fsdp2_features",
    "wrap_zero3",
    "zero3_optimizer",
]


def __getattr__(name: str):
    # zero3_chunk imports megatron-core at class definition: load it on first use only.
    if name in ("wrap_zero3", "zero3_optimizer", "Zero3Chunk"):
        from . import zero3_chunk

        return getattr(zero3_chunk, name)
    raise AttributeError(name)
