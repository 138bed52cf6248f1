"""Save and resume a training run exactly, in Megatron-LM's legacy (torch) checkpoint layout.

::

    <dir>/latest_checkpointed_iteration.txt              written last, through a fsynced temporary file
    <dir>/iter_0000005/metadata.json                     parallel sizes and chunk count (as before)
    <dir>/iter_0000005/manifest.json                     every file's size and sha256, layout, placement
    <dir>/iter_0000005/mp_rank_00_001/model_optim_rng.pt         plain optimizer: dp rank 0 of (tp 0, pp 1)
    <dir>/iter_0000005/mp_rank_00_001_003/model_optim_rng.pt     distributed optimizer: every dp rank
    <dir>/iter_0000005/mp_rank_00_001_002/model_optim_rng.pt     expert parallel, plain: ep rank 2
    <dir>/iter_0000005/mp_rank_00_001_002_001/model_optim_rng.pt expert parallel, distributed: ep 2, expert-dp 1

A save is atomic. Rank 0 empties the hidden ``.iter_0000005.partial`` folder; every writing rank
puts its file there and fsyncs it; the ranks' sizes and hashes are gathered to rank 0, which adds
``metadata.json`` and ``manifest.json``, fsyncs, renames the folder to ``iter_0000005`` and only
then replaces the tracker. A kill at any point leaves the tracker naming the previous complete
checkpoint. Every step's failure reaches every rank (no rank waits in a barrier for a dead one),
and all ranks raise ``CheckpointError``.

A load is decided once for all ranks: each rank checks the manifest, the layout and the files it
reads (sizes; the sha256 of the file it wrote; rank 0 also every size and no foreign file), the
verdicts are gathered, and if any rank cannot load, every rank raises the same ``CheckpointError``
naming what is missing or damaged: no rank ever starts from scratch while others resume.

With the plain optimizer the model and optimizer state are the same on every data-parallel
rank, so dp rank 0 writes them; the RNG states differ per rank (different data, dropout), so
they are gathered over the data-parallel group into that file and each rank restores its own.
With the distributed optimizer each dp rank holds a shard of the fp32 main params and Adam
moments that ``state_dict()`` leaves out, so every dp rank writes its shard
(``get_parameter_state_dp_reshardable``: no communication) and its RNG state; the model
weights are only in dp rank 0's file, which the others read (memory-mapped) on load.
With expert parallelism each ep rank of a data-parallel group holds other experts, so the
replicas are the expert-data-parallel group (the ranks of one ep rank): everything above applies
within it, and the file names gain the ep rank (Megatron-LM's legacy ``mp_rank_TT_PPP_EEE``).
Resuming needs the same tp, pp, dp (with context parallel), ep and chunk count: a checkpoint is
not resharded. The folder must be shared by all ranks. Files hold pickled Python objects: the
hashes catch damage, not tampering; load only checkpoints you trust.

What a rank's file holds (model, optimizer, RNG) and how it goes back: ``checkpoint_state``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint_state import (
    gather_rng_over_dp,
    is_distributed,
    load_model_states,
    load_optimizer,
    model_states,
    optimizer_parts,
    optimizer_state,
    rng_state,
    set_rng_state,
)
from .manifest import (
    FORMAT,
    LAYOUT_FIELDS,
    MANIFEST,
    METADATA,
    TRACKER,
    CheckpointError,
    CheckpointMissing,
    Layout,
    build_manifest,
    check_files,
    complete_iterations,
    find_latest,
    fsync_directory,
    iteration_directory,
    read_manifest,
    replace_durably,
    staging_directory,
    unexpected_files,
    write_durably,
)

__all__ = [
    "TRACKER", "METADATA", "MANIFEST", "FORMAT", "CheckpointError", "CheckpointMissing", "Layout",
    "iteration_directory", "save_checkpoint", "load_checkpoint", "resolve_iteration",
]  # fmt: skip

logger = logging.getLogger(__name__)

FILENAME = "model_optim_rng.pt"
Hook = Callable[[str, Path], None]


@dataclass(frozen=True)
class _Ranks:
    tp: int
    pp: int
    dp: int  # within the replicas of this rank's state: the expert-data-parallel rank when ep is set
    world: int
    ep: int | None = None  # the expert-parallel rank, None without expert parallelism


def save_checkpoint(
    directory: str | Path,
    iteration: int,
    chunks: list,
    optimizer,
    scheduler,
    extra: dict | None = None,
    hook: Hook | None = None,
) -> Path:
    """Write the checkpoint of ``iteration`` atomically (collective: call on every rank).

    ``chunks`` are this rank's model chunks (DDP-wrapped or not), ``optimizer`` megatron-core's
    (chained) optimizer and ``scheduler`` its OptimizerParamScheduler; either may be None.
    ``extra`` (args, schedule name, placement, ...) comes back from ``load_checkpoint``; its
    ``placement`` and ``schedule`` are also recorded in the manifest. ``hook(point, path)`` runs
    at each step of the commit ("written" on each writing rank, then on rank 0 "staged",
    "renamed", "tracker"): tests inject faults there. Returns the iteration directory; raises
    CheckpointError on every rank if any rank's part failed (the previous checkpoint stays).
    """
    extra = dict(extra or {})
    layout = _layout(chunks, optimizer)
    ranks = _ranks()
    directory = Path(directory)
    staging = staging_directory(directory, iteration)
    rng = rng_state()
    replicas = layout.dp // layout.ep  # dp = ep x expert dp (expert tensor parallel = tp, see _layout)
    expert = ranks.ep is not None
    rngs = {ranks.dp: rng} if layout.distributed_optimizer else gather_rng_over_dp(rng, ranks.dp, replicas, expert)
    _agreed(lambda: _prepare(staging) if ranks.world == 0 else None, f"preparing {staging}")
    written = None
    if layout.distributed_optimizer or ranks.dp == 0:
        payload: dict[str, Any] = {
            "format": FORMAT,
            "iteration": iteration,
            "layout": asdict(layout),
            "extra": extra,
            "rng_state": rngs,
            "optimizer": optimizer_state(optimizer) if optimizer is not None else None,
            "opt_param_scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        if ranks.dp == 0:
            payload.update(model_states(chunks))
        name = _rank_file(ranks, layout.distributed_optimizer)
        written = (name, *_outcome(lambda: _write_rank_file(staging / name, payload, hook)))
    records = _agreed_all(written, f"writing the checkpoint of iteration {iteration} into {staging}")
    files = {name: (size, digest) for name, size, digest in filter(None, records)}
    if ranks.world == 0:
        commit = lambda: _commit(directory, iteration, layout, files, extra, hook)  # noqa: E731
    else:
        commit = lambda: None  # noqa: E731
    _agreed(commit, f"committing the checkpoint of iteration {iteration} in {directory}")
    target = iteration_directory(directory, iteration)
    if ranks.world == 0:
        logger.info("saved checkpoint of iteration %d to %s", iteration, target)
    return target


def _prepare(staging: Path) -> None:
    """An empty staging folder: a killed save may have left files of its own there."""
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    fsync_directory(staging.parent)


def _write_rank_file(path: Path, payload: dict, hook: Hook | None) -> tuple[int, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    size, digest = write_durably(path, lambda file: torch.save(payload, file))
    fsync_directory(path.parent)
    if hook is not None:
        hook("written", path)
    return size, digest


def _commit(directory: Path, iteration: int, layout: Layout, files: dict, extra: dict, hook: Hook | None) -> None:
    """Rank 0: metadata and manifest into the staging folder, rename it into place, then the tracker."""
    staging, target = staging_directory(directory, iteration), iteration_directory(directory, iteration)
    meta = {"format": FORMAT, "iteration": iteration, **asdict(layout)}
    files[METADATA] = write_durably(staging / METADATA, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
    manifest = build_manifest(iteration, layout, files, extra)
    write_durably(staging / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
    fsync_directory(staging)
    if hook is not None:
        hook("staged", staging)
    if target.exists():  # saved by a run that was killed before its tracker moved; this run loaded an older one
        replaced = directory / f".{target.name}.replaced"
        if replaced.exists():
            shutil.rmtree(replaced)
        target.rename(replaced)
        staging.rename(target)
        fsync_directory(directory)
        shutil.rmtree(replaced)
    else:
        staging.rename(target)
        fsync_directory(directory)
    if hook is not None:
        hook("renamed", target)
    replace_durably(directory / TRACKER, f"{iteration}\n".encode(), hook)


def load_checkpoint(
    directory: str | Path, chunks: list, optimizer, scheduler, iteration: int | None = None
) -> tuple[int, dict]:
    """Restore model chunks, optimizer, scheduler and RNG states; returns (iteration, extra).

    ``iteration=None`` loads the one the tracker file names. Call it on every rank after
    building the model, optimizer and scheduler as for a fresh run: it is collective, and
    either every rank loads or every rank raises the same CheckpointError (CheckpointMissing
    when there is no checkpoint at all in ``directory``).
    """
    directory = Path(directory)
    ranks = _ranks()
    iteration, manifest = _agreed(lambda: _verify(directory, iteration, chunks, optimizer, ranks), "loading")
    target = iteration_directory(directory, iteration)
    extra = _agreed(lambda: _restore(target, manifest, chunks, optimizer, scheduler, ranks), f"restoring {target}")
    logger.info("loaded checkpoint of iteration %d from %s", iteration, target)
    return iteration, extra


def resolve_iteration(directory: str | Path, iteration: int | None = None) -> int:
    """The iteration to load (the tracker's when None), with its folder and manifest there; no collective."""
    directory = Path(directory)
    if iteration is None:
        iteration = find_latest(directory)
    folder = iteration_directory(directory, iteration)
    if not folder.is_dir():
        found = ", ".join(iteration_directory(directory, i).name for i in complete_iterations(directory))
        raise CheckpointError(
            f"no checkpoint of iteration {iteration} in {directory}: expected {folder}; "
            f"complete checkpoints there: {found or 'none'}"
        )
    read_manifest(folder)
    return iteration


def _verify(directory: Path, iteration: int | None, chunks: list, optimizer, ranks: _Ranks) -> tuple[int, dict]:
    """This rank's verdict: the files it reads are there with their sizes, the one it wrote with its hash."""
    iteration = resolve_iteration(directory, iteration)
    folder = iteration_directory(directory, iteration)
    manifest = read_manifest(folder)
    saved = Layout.from_dict(manifest["layout"])
    _check_layout(saved, _layout(chunks, optimizer, default_distributed=saved.distributed_optimizer), folder)
    distributed = saved.distributed_optimizer
    own = _rank_file(ranks, distributed)
    reads = [own] if distributed or ranks.dp == 0 else []
    reads.append(_rank_file(replace(ranks, dp=0), distributed))
    hashed = set(reads[:1]) if (distributed or ranks.dp == 0) else set()
    problems = check_files(folder, manifest, sorted(set(reads)), hashed)
    if ranks.world == 0:
        others = sorted(set(manifest["files"]) - set(reads))
        problems += check_files(folder, manifest, others, hashed={METADATA}) + unexpected_files(folder, manifest)
    if problems:
        raise CheckpointError("; ".join(problems))
    return iteration, manifest


def _restore(target: Path, manifest: dict, chunks: list, optimizer, scheduler, ranks: _Ranks) -> dict:
    distributed = manifest["layout"]["distributed_optimizer"]
    own = _read(target / _rank_file(ranks, distributed))
    models = own
    if distributed and ranks.dp != 0:  # the weights are in dp rank 0's file only
        models = _read(target / _rank_file(replace(ranks, dp=0), True), mmap=True)
    load_model_states(chunks, models)
    for what, given in (("optimizer", optimizer), ("opt_param_scheduler", scheduler)):
        if given is not None and own[what] is None:
            raise CheckpointError(f"checkpoint {target} was saved without {what} state; load it with {what}=None")
    if optimizer is not None:
        load_optimizer(optimizer, own["optimizer"])
    if scheduler is not None:
        scheduler.num_steps = 0  # load_state_dict steps by the saved count from wherever it stands
        scheduler.load_state_dict(own["opt_param_scheduler"])
    set_rng_state(own["rng_state"][ranks.dp])
    return own["extra"]


def _check_layout(saved: Layout, current: Layout, target: Path) -> None:
    differs = [
        f"{name}: checkpoint {getattr(saved, name)}, this run {getattr(current, name)}"
        for name in LAYOUT_FIELDS
        if getattr(saved, name) != getattr(current, name)
    ]
    if differs:
        raise CheckpointError(
            f"checkpoint {target} was saved with {saved.describe()}, this run has {current.describe()} "
            f"({'; '.join(differs)}); resume with the same parallel sizes, chunk count and optimizer kind "
            f"(checkpoints are not resharded)"
        )


# -- one decision for all ranks -----------------------------------------------------------------
def _outcome(action: Callable) -> tuple[Any, tuple[str, str] | None]:
    try:
        return action(), None
    except Exception as error:  # every failure is reported to every rank
        kind = "missing" if isinstance(error, CheckpointMissing) else "error"
        text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
        return None, (kind, text)


def _agreed_all(written: tuple | None, what: str) -> list:
    """Every rank's (name, (size, sha256) | None, failure) record; raises on every rank if any failed."""
    if written is None:
        record, failure = None, None
    else:
        name, value, failure = written
        record = None if failure else (name, *value)
    records = _gather((record, failure))
    _raise_if_failed([f for _, f in records], what)
    return [r for r, _ in records]


def _agreed(action: Callable, what: str):
    """``action()`` on this rank; if it failed on any rank, every rank raises the same CheckpointError."""
    value, failure = _outcome(action)
    _raise_if_failed(_gather(failure), what)
    return value


def _gather(value) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _raise_if_failed(failures: list, what: str) -> None:
    """One message for all ranks: each distinct problem with the ranks that met it."""
    if not any(failures):
        return
    by_text: dict[str, list[int]] = {}
    for rank, failure in enumerate(failures):
        if failure:
            by_text.setdefault(failure[1], []).append(rank)
    if len(failures) == 1:
        text = next(iter(by_text))
    else:
        text = "; ".join(f"{_ranks_text(r, len(failures))}: {t}" for t, r in by_text.items())
    if all(f and f[0] == "missing" for f in failures):
        raise CheckpointMissing(text)
    raise CheckpointError(f"{what} failed: {text}" if what != "loading" else text)


def _ranks_text(ranks: list[int], world: int) -> str:
    if len(ranks) == world:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# -- layout and files -------------------------------------------------------------------------
def _layout(chunks: list, optimizer, default_distributed: bool = False) -> Layout:
    distributed = any(map(is_distributed, optimizer_parts(optimizer))) if optimizer is not None else default_distributed
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        _require_single_process()
        return Layout(1, 1, 1, len(chunks), distributed)
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1 and ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size():
        raise ValueError(
            "checkpoints with expert parallelism need --expert-tensor-parallel-size equal to "
            f"--tensor-model-parallel-size ({ps.get_expert_tensor_parallel_world_size()} and "
            f"{ps.get_tensor_model_parallel_world_size()} here): the files are named by tp and ep rank"
        )
    return Layout(
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        len(chunks),
        distributed,
        ep,
    )


def _ranks() -> _Ranks:
    from megatron.core import parallel_state as ps

    world = dist.get_rank() if dist.is_initialized() else 0
    if not ps.model_parallel_is_initialized():
        _require_single_process()
        return _Ranks(0, 0, 0, world)
    if ps.get_expert_model_parallel_world_size() > 1:
        # Each ep rank holds other experts: the copies of this rank's state are its expert-dp group.
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        return _Ranks(tp, pp, ps.get_expert_data_parallel_rank(), world, ps.get_expert_model_parallel_rank())
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


def _rank_file(ranks: _Ranks, distributed: bool) -> str:
    """This rank's file, relative to the iteration folder (Megatron-LM's legacy names)."""
    name = f"mp_rank_{ranks.tp:02d}_{ranks.pp:03d}" + (f"_{ranks.ep:03d}" if ranks.ep is not None else "")
    name += f"_{ranks.dp:03d}" if distributed else ""
    return f"{name}/{FILENAME}"


def _read(path: Path, mmap: bool = False) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
