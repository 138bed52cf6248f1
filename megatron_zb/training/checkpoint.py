"""Save and resume a training run exactly, in Megatron-LM's legacy (torch) checkpoint layout.

::

    <dir>/latest_checkpointed_iteration.txt              written last, after a barrier
    <dir>/iter_0000005/metadata.json                     parallel sizes and chunk count
    <dir>/iter_0000005/mp_rank_00_001/model_optim_rng.pt         plain optimizer: dp rank 0 of (tp 0, pp 1)
    <dir>/iter_0000005/mp_rank_00_001_003/model_optim_rng.pt     distributed optimizer: every dp rank

With the plain optimizer the model and optimizer state are the same on every data-parallel
rank, so dp rank 0 writes them; the RNG states differ per rank (different data, dropout), so
they are gathered over the data-parallel group into that file and each rank restores its own.
With the distributed optimizer each dp rank holds a shard of the fp32 main params and Adam
moments that ``state_dict()`` leaves out, so every dp rank writes its shard
(``get_parameter_state_dp_reshardable``: no communication) and its RNG state; the model
weights are only in dp rank 0's file, which the others read (memory-mapped) on load.
Resuming needs the same tp, pp, dp (with context parallel) and chunk count: a checkpoint is
not resharded. Files hold pickled Python objects: load only checkpoints you trust.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FILENAME = "model_optim_rng.pt"
FORMAT = "megatron-zb-legacy-1"


@dataclass(frozen=True)
class Layout:
    """What must match between the saving and the resuming run."""

    tp: int
    pp: int
    dp: int  # data parallel with context parallel: the ranks that share one (tp, pp) model shard
    chunks: int
    distributed_optimizer: bool

    def describe(self) -> str:
        kind = "distributed" if self.distributed_optimizer else "plain"
        return f"tp={self.tp} pp={self.pp} dp={self.dp} chunks={self.chunks} ({kind} optimizer)"


_FIELDS = tuple(f.name for f in fields(Layout))


@dataclass(frozen=True)
class _Ranks:
    tp: int
    pp: int
    dp: int
    world: int


def iteration_directory(directory: str | Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def save_checkpoint(
    directory: str | Path, iteration: int, chunks: list, optimizer, scheduler, extra: dict | None = None
) -> Path:
    """Write this rank's part of the checkpoint for ``iteration`` (collective: call on every rank).

    ``chunks`` are this rank's model chunks (DDP-wrapped or not), ``optimizer`` megatron-core's
    (chained) optimizer and ``scheduler`` its OptimizerParamScheduler; either may be None.
    ``extra`` (args, schedule name, ...) comes back from ``load_checkpoint``. Returns the
    iteration directory. The tracker file is written last, so a crash never points at a
    partial checkpoint.
    """
    layout = _layout(chunks, optimizer)
    ranks = _ranks()
    target = iteration_directory(directory, iteration)
    rng = _rng_state()
    rngs = {ranks.dp: rng} if layout.distributed_optimizer else _gather_over_dp(rng, ranks, layout.dp)
    if layout.distributed_optimizer or ranks.dp == 0:
        payload: dict[str, Any] = {
            "format": FORMAT,
            "iteration": iteration,
            "layout": asdict(layout),
            "extra": dict(extra or {}),
            "rng_state": rngs,
            "optimizer": _optimizer_state(optimizer) if optimizer is not None else None,
            "opt_param_scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        if ranks.dp == 0:
            payload.update(_model_states(chunks))
        path = _rank_file(target, ranks, layout.distributed_optimizer)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda tmp: torch.save(payload, tmp))
    if ranks.world == 0:
        target.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "iteration": iteration, **asdict(layout)}
        _atomic_write(target / METADATA, lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
    _barrier()
    if ranks.world == 0:
        _atomic_write(Path(directory) / TRACKER, lambda tmp: tmp.write_text(f"{iteration}\n"))
        logger.info("saved checkpoint of iteration %d to %s", iteration, target)
    _barrier()
    return target


def load_checkpoint(
    directory: str | Path, chunks: list, optimizer, scheduler, iteration: int | None = None
) -> tuple[int, dict]:
    """Restore model chunks, optimizer, scheduler and RNG states; returns (iteration, extra).

    ``iteration=None`` loads the one the tracker file names. Call it on every rank after
    building the model, optimizer and scheduler as for a fresh run (no collective inside).
    """
    iteration = resolve_iteration(directory, iteration)
    target = iteration_directory(directory, iteration)
    saved = Layout(**{k: v for k, v in json.loads((target / METADATA).read_text()).items() if k in _FIELDS})
    distributed = saved.distributed_optimizer
    current = _layout(chunks, optimizer, default_distributed=distributed)
    _check_layout(saved, current, target)
    ranks = _ranks()
    own = _read(_rank_file(target, ranks, distributed))
    models = own
    if distributed and ranks.dp != 0:  # the weights are in dp rank 0's file only
        models = _read(_rank_file(target, _Ranks(ranks.tp, ranks.pp, 0, ranks.world), True), mmap=True)
    for key, chunk in zip(_model_keys(len(chunks)), chunks, strict=True):
        chunk.load_state_dict(models[key], strict=True)
    for what, given in (("optimizer", optimizer), ("opt_param_scheduler", scheduler)):
        if given is not None and own[what] is None:
            raise ValueError(f"checkpoint {target} was saved without {what} state; load it with {what}=None")
    if optimizer is not None:
        _load_optimizer(optimizer, own["optimizer"])
    if scheduler is not None:
        scheduler.num_steps = 0  # load_state_dict steps by the saved count from wherever it stands
        scheduler.load_state_dict(own["opt_param_scheduler"])
    _set_rng_state(own["rng_state"][ranks.dp])
    logger.info("loaded checkpoint of iteration %d from %s", iteration, target)
    return iteration, own["extra"]


def resolve_iteration(directory: str | Path, iteration: int | None = None) -> int:
    """The iteration to load (the tracker's when None); FileNotFoundError when it is not there."""
    directory = Path(directory)
    if iteration is None:
        tracker = directory / TRACKER
        if not tracker.is_file():
            what = "directory does not exist" if not directory.exists() else f"{TRACKER} is missing"
            raise FileNotFoundError(
                f"no checkpoint in {directory}: {what}; expected {tracker} naming the latest saved iteration "
                f"(save_checkpoint writes it last), or pass iteration= explicitly"
            )
        text = tracker.read_text().strip()
        if not text.isdigit():
            raise ValueError(
                f"{tracker} holds {text!r}; expected an iteration number (release checkpoints unsupported)"
            )
        iteration = int(text)
    meta = iteration_directory(directory, iteration) / METADATA
    if not meta.is_file():
        found = sorted(p.name for p in directory.glob("iter_*") if (p / METADATA).is_file())
        raise FileNotFoundError(
            f"no checkpoint of iteration {iteration} in {directory}: expected {meta}; "
            f"complete checkpoints there: {', '.join(found) or 'none'}"
        )
    return iteration


def _check_layout(saved: Layout, current: Layout, target: Path) -> None:
    differs = [
        f"{name}: checkpoint {getattr(saved, name)}, this run {getattr(current, name)}"
        for name in _FIELDS
        if getattr(saved, name) != getattr(current, name)
    ]
    if differs:
        raise ValueError(
            f"checkpoint {target} was saved with {saved.describe()}, this run has {current.describe()} "
            f"({'; '.join(differs)}); resume with the same parallel sizes, chunk count and optimizer kind "
            f"(checkpoints are not resharded)"
        )


# -- layout and files -------------------------------------------------------------------------
def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def _layout(chunks: list, optimizer, default_distributed: bool = False) -> Layout:
    distributed = any(map(_is_distributed, _parts(optimizer))) if optimizer is not None else default_distributed
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        _require_single_process()
        return Layout(1, 1, 1, len(chunks), distributed)
    if ps.get_expert_model_parallel_world_size() > 1:
        raise ValueError("checkpoints with expert parallelism (expert_model_parallel_size > 1) are not supported")
    return Layout(
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        len(chunks),
        distributed,
    )


def _ranks() -> _Ranks:
    from megatron.core import parallel_state as ps

    world = dist.get_rank() if dist.is_initialized() else 0
    if not ps.model_parallel_is_initialized():
        _require_single_process()
        return _Ranks(0, 0, 0, world)
    return _Ranks(
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
        world,
    )


def _require_single_process() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "checkpoints of several processes need megatron-core's parallel state: "
            "call parallel_state.initialize_model_parallel(...) first"
        )


def _rank_file(target: Path, ranks: _Ranks, distributed: bool) -> Path:
    name = f"mp_rank_{ranks.tp:02d}_{ranks.pp:03d}" + (f"_{ranks.dp:03d}" if distributed else "")
    return target / name / FILENAME


def _read(path: Path, mmap: bool = False) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing (the checkpoint is incomplete or was moved)")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# -- model and optimizer ----------------------------------------------------------------------
def _model_keys(count: int) -> list[str]:
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def _model_states(chunks: list) -> dict:
    states = {}
    for key, chunk in zip(_model_keys(len(chunks)), chunks, strict=True):
        save = getattr(chunk, "state_dict_for_save_checkpoint", chunk.state_dict)
        states[key] = _cpu_copy(save())
    return states


def _cpu_copy(value):
    """Own CPU copies: a view into DDP's flat buffer would otherwise save the whole buffer."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_cpu_copy(v) for v in value)
    return value


def _optimizer_state(optimizer) -> list[dict]:
    """One state dict per chained optimizer; a distributed one carries this rank's shard too."""
    states = []
    for part in _parts(optimizer):
        if _is_distributed(part):
            if not part.optimizer.state:
                raise ValueError("the distributed optimizer has no state before its first step; save after training")
            state = part.state_dict()
            shard = part.get_parameter_state_dp_reshardable()
            for by_dtype in (v for k, v in shard.items() if isinstance(k, int)):
                for buckets in by_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry["padding"] = False  # load_parameter_state_from_dp_reshardable filters on it
            state["param_state"] = shard
            state["param_state_sharding_type"] = "dp_reshardable"
        else:
            state = part.state_dict()
        states.append(_cpu_copy(state))
    return states


def _load_optimizer(optimizer, states: list[dict]) -> None:
    parts = _parts(optimizer)
    if len(states) != len(parts):
        raise ValueError(f"checkpoint holds {len(states)} chained optimizer(s), this run has {len(parts)}")
    # no_grad: with fp32 params the distributed optimizer's main params are views of the model
    # params, and its load copies into them in place.
    with torch.no_grad():
        if hasattr(optimizer, "chained_optimizers") and len(parts) > 1:
            optimizer.load_state_dict(states)
        else:
            optimizer.load_state_dict(states[0])
    for part in parts:
        _unshare_steps(part)


def _unshare_steps(part) -> None:
    """Give each parameter its own Adam step tensor.

    The distributed optimizer's load_state_dict allocates a fresh state with one ``step``
    tensor shared by every parameter (torch Adam keeps it uncopied); each step would then
    advance it once per parameter and change the bias correction.
    """
    inner = getattr(part, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            state["step"] = step.clone()


# -- RNG --------------------------------------------------------------------------------------
def _rng_state() -> dict:
    state: dict[str, Any] = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    try:
        import numpy

        state["np_rng_state"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    from megatron.core import tensor_parallel

    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    if tracker_states:
        state["rng_tracker_states"] = _cpu_copy(tracker_states)
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "np_rng_state" in state:
        import numpy

        numpy.random.set_state(state["np_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if "rng_tracker_states" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _gather_over_dp(rng: dict, ranks: _Ranks, dp_size: int) -> dict[int, dict] | None:
    """Every dp rank's RNG state, on dp rank 0 (None elsewhere)."""
    if dp_size == 1:
        return {0: rng}
    from megatron.core import parallel_state as ps

    try:
        group = ps.get_data_parallel_group_gloo(with_context_parallel=True)
    except (AssertionError, RuntimeError):
        group = None
    group = group or ps.get_data_parallel_group(with_context_parallel=True)
    gathered = [None] * dp_size if ranks.dp == 0 else None
    dist.gather_object(rng, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return dict(enumerate(gathered)) if gathered is not None else None
