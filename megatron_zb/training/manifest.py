"""A checkpoint folder's files without torch: tracker, manifest, durable writes, and the checks before spawn.

Every iteration folder holds ``manifest.json``: the iteration, the layout (tp, pp, dp, chunks,
optimizer kind), the placement and schedule, the model's shape and the optimizer, and each file's
size and sha256, with a hash of the manifest itself. A checkpoint is loaded only if every file it
names is there, with its size and hash: a truncated, empty, bit-flipped or foreign file (mixed from another save) is
refused by name. The launcher reads the manifest before it spawns anything (``check_before_spawn``),
so a layout mismatch, a missing or truncated file, or a ``--save`` that would write over
checkpoints this run did not load is refused in a second, not after the model is built.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
MANIFEST = "manifest.json"
FORMAT = "megatron-zb-legacy-2"  # version 2 adds manifest.json
_ITERATION = re.compile(r"iter_(\d{7,})")


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (or saved over); the message names the file or flag."""


class CheckpointMissing(CheckpointError):
    """There is no checkpoint at all where one was asked for (a fresh run may start from scratch)."""


@dataclass(frozen=True)
class Layout:
    """What must match between the saving and the resuming run."""

    tp: int
    pp: int
    dp: int  # data parallel with context parallel: the ranks that share one (tp, pp) model shard
    chunks: int
    distributed_optimizer: bool
    ep: int = 1  # expert parallel: each of these ranks (within dp) holds other experts

    def describe(self) -> str:
        kind = "distributed" if self.distributed_optimizer else "plain"
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{ep} chunks={self.chunks} ({kind} optimizer)"

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """Checkpoints written before ``ep`` was recorded had no expert parallelism (it was refused)."""
        return cls(**{f.name: data.get(f.name, f.default) if f.name == "ep" else data[f.name] for f in fields(cls)})


LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))
_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "dp": "the data-parallel size (processes / (tensor x pipeline))",
    "chunks": "the schedule's chunks per rank (--pipeline-schedule / --virtual-pipeline-model-parallel-size)",
    "distributed_optimizer": "--use-distributed-optimizer",
    "ep": "--expert-model-parallel-size",
}


# What the weights' shapes follow (args field -> flag): a checkpoint of another shape cannot load.
MODEL_FIELDS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "padded_vocab_size": "--vocab-size (or the tokenizer's vocabulary, padded)",
    "max_position_embeddings": "--max-position-embeddings",
    "swiglu": "--swiglu",
    "normalization": "--normalization",
    "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--add-qkv-bias",
    "qk_layernorm": "--qk-layernorm",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "position_embedding_type": "--position-embedding-type",
    "num_experts": "--num-experts",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
}


def model_shape(args: argparse.Namespace) -> dict:
    """The flags the weights' shapes follow, as a run records them in its manifest."""
    shape = {name: getattr(args, name, None) for name in MODEL_FIELDS}
    if not getattr(args, "group_query_attention", False):
        shape["num_query_groups"] = None
    return shape


def placement_text(placement) -> str:
    """How a checkpoint records where the layer blocks sit (a placement, or every pipe's: BitPipe has two)."""
    placements = placement if isinstance(placement, tuple) else (placement,)
    return " + ".join(f"{p.kind} pp={p.pp} chunks={p.chunks}" for p in placements)


def iteration_directory(directory: str | Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def staging_directory(directory: str | Path, iteration: int) -> Path:
    """Where a save writes before the rename; hidden, so nothing takes it for a checkpoint."""
    return Path(directory) / f".iter_{iteration:07d}.partial"


def iterations_in(directory: str | Path) -> list[int]:
    """The iterations that have an ``iter_*`` folder (complete or not), ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = (_ITERATION.fullmatch(p.name) for p in directory.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def complete_iterations(directory: str | Path) -> list[int]:
    """The iterations whose folder holds a manifest (its files are not verified here)."""
    return [i for i in iterations_in(directory) if (iteration_directory(directory, i) / MANIFEST).is_file()]


def _complete_text(directory: Path) -> str:
    names = [iteration_directory(directory, i).name for i in complete_iterations(directory)]
    return f"complete checkpoints there: {', '.join(names) or 'none'}"


def find_latest(directory: str | Path) -> int:
    """The iteration the tracker names, checked to exist.

    CheckpointMissing when there is nothing at all (no folder, or neither tracker nor iteration
    folders); CheckpointError when the tracker is missing, unreadable or names an absent folder
    while checkpoints sit beside it: never a silent start from scratch.
    """
    directory = Path(directory)
    tracker = directory / TRACKER
    if not directory.exists():
        raise CheckpointMissing(f"no checkpoint in {directory}: the directory does not exist")
    if not tracker.is_file():
        found = iterations_in(directory)
        if not found:
            raise CheckpointMissing(f"no checkpoint in {directory}: {TRACKER} is missing and there is no iter_* folder")
        raise CheckpointError(
            f"{tracker} is missing but {directory} holds iter_* folders ({_complete_text(directory)}); write the "
            f"iteration to resume from into {tracker} (e.g. the newest complete one), or move the folders away"
        )
    text = tracker.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker} holds {text!r}; expected an iteration number (release checkpoints unsupported)"
        )
    iteration = int(text)
    if not iteration_directory(directory, iteration).is_dir():
        raise CheckpointError(
            f"{tracker} names iteration {iteration}, but {iteration_directory(directory, iteration)} does not exist "
            f"({_complete_text(directory)}); write one of those into {tracker}"
        )
    return iteration


def read_manifest(folder: Path) -> dict:
    """The manifest of one iteration folder, checked against its own hash; CheckpointError names the file."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing (the save of {folder.name} did not finish, or an older megatron-zb or another tool "
            f"wrote it): the checkpoint cannot be verified; {_complete_text(folder.parent)}"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
        intact = manifest["manifest_sha256"] == _json_hash(body)
        Layout.from_dict(manifest["layout"])
        files = {name: (int(e["size"]), str(e["sha256"])) for name, e in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"{path} is damaged ({type(error).__name__}: {error}); the checkpoint cannot be verified"
        ) from None
    if not intact:
        raise CheckpointError(f"{path} does not match its own sha256: the manifest is damaged")
    if manifest.get("format") != FORMAT or _ITERATION.fullmatch(folder.name) is None:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} in folder {folder.name}; expected {FORMAT}")
    if int(_ITERATION.fullmatch(folder.name).group(1)) != manifest["iteration"]:
        raise CheckpointError(f"{path} records iteration {manifest['iteration']} but sits in {folder.name}")
    manifest["files"] = files
    return manifest


def build_manifest(iteration: int, layout: Layout, files: dict[str, tuple[int, str]], extra: dict) -> dict:
    body = {
        "format": FORMAT,
        "iteration": iteration,
        "layout": asdict(layout),
        "placement": extra.get("placement"),
        "schedule": extra.get("schedule"),
        "model": extra.get("model"),
        "optimizer": extra.get("optimizer"),
        "files": {name: {"size": size, "sha256": digest} for name, (size, digest) in sorted(files.items())},
    }
    return {**body, "manifest_sha256": _json_hash(body)}


def check_files(folder: Path, manifest: dict, names: list[str], hashed: set[str]) -> list[str]:
    """Problems with ``names`` (relative to ``folder``): missing, another size, or (for ``hashed``) another sha256."""
    problems = []
    for name in names:
        path = folder / name
        if name not in manifest["files"]:
            problems.append(f"{path} is not in {folder / MANIFEST} (a file of another layout or save)")
            continue
        size, digest = manifest["files"][name]
        if not path.is_file():
            problems.append(f"checkpoint file {path} is missing (the checkpoint is incomplete or was moved)")
        elif (actual := path.stat().st_size) != size:
            what = "empty" if actual == 0 else f"{actual} bytes"
            problems.append(
                f"checkpoint file {path} is {what}, {MANIFEST} records {size} bytes (truncated or replaced)"
            )
        elif name in hashed and sha256_of(path) != digest:
            problems.append(
                f"checkpoint file {path} does not match its sha256 in {MANIFEST} (damaged, or a file of another save)"
            )
    return problems


def unexpected_files(folder: Path, manifest: dict) -> list[str]:
    """Files in ``folder`` that the manifest does not name (e.g. copied in from another run)."""
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    return [f"{folder / name} is not in {MANIFEST}" for name in sorted(found - set(manifest["files"]) - {MANIFEST})]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _json_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# -- durable writes -----------------------------------------------------------------------------
def write_durably(path: Path, write: Callable) -> tuple[int, str]:
    """``write(file)`` into ``path`` (opened "wb"), flushed and fsynced; returns (size, sha256)."""
    with path.open("wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    return path.stat().st_size, sha256_of(path)


def fsync_directory(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def replace_durably(path: Path, data: bytes, hook: Callable | None = None) -> None:
    """Write ``path`` through a fsynced temporary file and a rename: readers see the old or the new bytes."""
    tmp = path.with_name(path.name + ".tmp")
    write_durably(tmp, lambda file: file.write(data))
    if hook is not None:
        hook("tracker", tmp)
    os.replace(tmp, path)
    fsync_directory(path.parent)


# -- before spawn -------------------------------------------------------------------------------
def check_before_spawn(args: argparse.Namespace) -> None:
    """Refuse --load/--save settings that would fail after spawn or destroy checkpoints (CheckpointError).

    Reads the tracker and the manifest of --load (with --cpu also every file's sha256; under torchrun the
    ranks verify those), compares its layout, model shape and optimizer kind with this run's, and refuses
    a --save folder holding checkpoints at or after the first iteration this run would save, unless the
    run resumes from that very folder.
    """
    missing_flag = getattr(args, "exit_on_missing_checkpoint", False)
    if missing_flag and not args.load:
        raise CheckpointError("--exit-on-missing-checkpoint needs --load DIRECTORY")
    if args.load and Path(args.load).exists() and not Path(args.load).is_dir():
        raise CheckpointError(
            f"--load {args.load} is a file; give the checkpoint folder (the --save folder of the run to resume, which "
            f"holds {TRACKER} and iter_* folders)"
        )
    start, resumes_from = 0, None
    if args.load:
        try:
            start = find_latest(args.load)
        except CheckpointMissing as missing:
            if missing_flag:
                raise CheckpointError(
                    f"--load {args.load}: {missing}; --exit-on-missing-checkpoint makes that an error "
                    f"(drop the flag to start from scratch)"
                ) from None
        except CheckpointError as error:
            raise CheckpointError(f"--load {args.load}: {error}") from None
        else:
            _check_loadable(args, iteration_directory(args.load, start))
            resumes_from = Path(args.load).resolve()
    if args.save and Path(args.save).resolve() != resumes_from:
        _check_save(args, start)


def _check_loadable(args: argparse.Namespace, folder: Path) -> None:
    try:
        manifest = read_manifest(folder)
    except CheckpointError as error:
        raise CheckpointError(f"--load {args.load}: {error}") from None
    saved = asdict(Layout.from_dict(manifest["layout"]))
    ours = {
        "tp": args.tensor_model_parallel_size,
        "pp": args.pipeline_model_parallel_size,
        "dp": args.data_parallel_size * getattr(args, "context_parallel_size", 1),
        "chunks": sum(placement.chunks for placement in args.placements),
        "distributed_optimizer": bool(args.use_distributed_optimizer),
        "ep": getattr(args, "expert_model_parallel_size", 1) or 1,
    }
    differs = [f"{_FLAGS[k]}: checkpoint {saved[k]}, this run {ours[k]}" for k in LAYOUT_FIELDS if saved[k] != ours[k]]
    if manifest["placement"] is not None and manifest["placement"] != placement_text(_placements(args)):
        differs.append(
            f"--pipeline-schedule: the checkpoint holds the {manifest['placement']} placement "
            f"({manifest['schedule']}), this run uses {placement_text(_placements(args))}"
        )
    if differs:
        raise CheckpointError(
            f"--load {args.load}: {folder.name} was saved with another layout ({'; '.join(differs)}); resume with "
            f"the same parallel sizes, optimizer kind and a schedule of the same placement (checkpoints are not "
            f"resharded)"
        )
    _check_model_and_optimizer(args, folder, manifest)
    # The launcher holds the files: it verifies every hash before spawning (under torchrun each rank does its own).
    names = sorted(manifest["files"])
    problems = check_files(folder, manifest, names, hashed=set(names) if getattr(args, "cpu", False) else set())
    problems += unexpected_files(folder, manifest)
    if problems:
        raise CheckpointError(f"--load {args.load}: {'; '.join(problems)}")


def _check_model_and_optimizer(args: argparse.Namespace, folder: Path, manifest: dict) -> None:
    """The weights' shapes and the optimizer's kind must match the checkpoint's (recorded since format 2 + model)."""
    saved = manifest.get("model")
    if saved is not None:
        ours = model_shape(args)
        differs = [
            f"{MODEL_FIELDS[name]}: checkpoint {saved[name]}, this run {ours[name]}"
            for name in MODEL_FIELDS
            if name in saved and saved[name] != ours[name]
        ]
        if differs:
            raise CheckpointError(
                f"--load {args.load}: {folder.name} holds a model of another shape ({'; '.join(differs)}); resume with "
                "the flags it was saved with"
            )
    optimizer = manifest.get("optimizer")
    if optimizer is not None and optimizer != getattr(args, "optimizer", optimizer):
        raise CheckpointError(
            f"--load {args.load}: {folder.name} holds the state of --optimizer {optimizer} (its moments and step), "
            f"which --optimizer {args.optimizer} cannot resume from; resume with --optimizer {optimizer}"
        )


def first_save(args: argparse.Namespace, start: int) -> int | None:
    """The first iteration after ``start`` at which the training loop saves (None if it saves none)."""
    stop = args.train_iters
    if args.exit_interval and args.exit_interval > 0:
        stop = min(stop, (start // args.exit_interval + 1) * args.exit_interval)
    if stop <= start:
        return None
    if args.save_interval and args.save_interval > 0:
        return min(stop, (start // args.save_interval + 1) * args.save_interval)
    return stop


def _check_save(args: argparse.Namespace, start: int) -> None:
    first = first_save(args, start)
    if first is None:
        return
    tracker = Path(args.save) / TRACKER
    held = set(iterations_in(args.save))
    if tracker.is_file() and tracker.read_text(errors="replace").strip().isdigit():
        held.add(int(tracker.read_text().strip()))
    clash = sorted(i for i in held if i >= first)
    if clash:
        load = f"--load {args.load} (iteration {start})" if args.load and start else "no checkpoint (a fresh run)"
        raise CheckpointError(
            f"--save {args.save} holds checkpoints of iterations {', '.join(map(str, clash))} that this run did not "
            f"load: it resumes from {load} and would save from iteration {first} on, over or behind them; resume "
            f"with --load {args.save}, or give --save an empty folder"
        )


def _placements(args):
    placements = getattr(args, "placements", None) or (args.placement,)
    return placements if len(placements) > 1 else placements[0]
