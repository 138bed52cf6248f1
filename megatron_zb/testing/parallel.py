"""Helpers for cases run inside a WorkerPool (megatron parallel state and gradient comparison), or in the pytest
process itself as one gloo rank."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import torch

_current: tuple | None = None


def init_parallel(tp: int = 1, pp: int = 1) -> None:
    """(Re)initialise megatron-core's parallel state when the sizes change; data parallel fills the rest."""
    global _current
    from megatron.core import parallel_state

    from megatron_zb.process_groups import destroy_model_parallel

    if _current == (tp, pp) and parallel_state.model_parallel_is_initialized():
        return
    destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _current = (tp, pp)


@contextlib.contextmanager
def one_gloo_rank() -> Iterator[None]:
    """This process as the only rank of a gloo group, megatron-core on CPU with parallel sizes 1; undone after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb import cpu
    from megatron_zb.process_groups import destroy_model_parallel

    cpu.enable()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=0, world_size=1)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


def gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The accumulated gradient: DDP's main_grad when wrapped, else .grad."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def compare_to_blocks(chunks: list, blocks: list, schedule, rank: int, slices: dict | None = None) -> tuple[float, int]:
    """Worst relative gradient difference between this rank's chunks and the reference blocks.

    Relative to the largest reference entry of each parameter; returns (worst, parameters
    compared). ``slices`` limits a parameter to the flat range this rank holds reduced
    (distributed optimizer); parameters missing from it are skipped.
    """
    worst, compared = 0.0, 0
    for placement in schedule.placements:
        for block, (owner, chunk) in enumerate(placement.blocks):
            if owner != rank:
                continue
            reference = dict(unwrapped(blocks[block]).named_parameters())
            for name, param in unwrapped(chunks[chunk]).named_parameters():
                mine, theirs = gradient(param), gradient(reference[name])
                if theirs is None or mine is None:
                    if (theirs is None) != (mine is None):
                        raise AssertionError(f"block {block} {name}: gradient present on one side only")
                    continue
                if slices is not None:
                    if param not in slices:
                        continue
                    low, high = slices[param]
                    mine, theirs = mine.reshape(-1)[low:high], theirs.reshape(-1)[low:high]
                scale = theirs.abs().max().clamp(min=1e-30)
                worst = max(worst, float((mine.float() - theirs.float()).abs().max() / scale))
                compared += 1
    return worst, compared


def relative_difference(ours: list[float], reference: list[float]) -> float:
    if len(ours) != len(reference):
        raise AssertionError(f"{len(ours)} losses against {len(reference)} reference losses")
    return max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours, reference, strict=True)), default=0.0)


def reduced_slices(ddp_module, dp_rank: int, dp_size: int) -> dict:
    """Flat range of each parameter's main_grad that the distributed optimizer's reduce-scatter fills here."""
    found = {}
    for buffer in ddp_module.buffers:
        for bucket in buffer.buckets:
            shard = bucket.grad_data.numel() // dp_size
            low, high = bucket.offset + dp_rank * shard, bucket.offset + (dp_rank + 1) * shard
            for param in bucket.params_list:
                start, end, _ = buffer.param_index_map[param]
                if max(start, low) < min(end, high):
                    found[param] = (max(start, low) - start, min(end, high) - start)
    return found
