"""``megatron-zb verify`` where no Megatron-LM is importable: megatron-zb's own training loop.

It takes the user's pretrain_gpt flags (the launcher's subset), shrinks the model (layers, hidden
size, sequence, vocabulary; dropout 0, mock data) but keeps the schedule, the pipeline and
tensor-parallel sizes, the precision and the optimizer flags, and trains the copy for a few
iterations twice in one set of gloo processes: once with megatron-core's own schedule, once with
theirs. Both start from the same weights (``placement_independent_init``), so losses,
per-iteration grad norms and per-parameter gradient checksums must agree.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from .verdict import TOLERANCE, Run, compare, report

PROG = "megatron-zb verify"
NO_SCHEDULE = (
    "no megatron-zb schedule in these flags (e.g. --pipeline-schedule zb-v): there is nothing to compare with "
    "megatron-core's own schedule"
)


def scaled_copy(user: argparse.Namespace, verify: argparse.Namespace) -> argparse.Namespace:
    """The user's settings on a small model: what the schedule depends on is kept, the sizes shrink."""
    from ..training.arguments import derive_and_check

    tp, pp = user.tensor_model_parallel_size, user.pipeline_model_parallel_size
    args = copy.copy(user)
    heads = 2 * tp
    vars(args).update(
        cpu=True,
        cpu_procs=tp * pp * verify.verify_data_parallel,
        num_attention_heads=heads,
        hidden_size=16 * heads,
        ffn_hidden_size=None,
        seq_length=16,
        max_position_embeddings=None,
        tokenizer_type="NullTokenizer",
        vocab_size=63,
        make_vocab_size_divisible_by=16,
        mock_data=True,
        data_path=None,
        vocab_file=None,
        merge_file=None,
        tokenizer_model=None,
        eval_iters=0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=False,  # needs apex's LayerNorm: not on CPU
        micro_batch_size=min(user.micro_batch_size, 2),
        train_iters=verify.verify_iters,
        lr_warmup_iters=0,
        lr_decay_iters=None,
        log_interval=verify.verify_iters,
        save=None,
        save_interval=None,
        load=None,
        exit_interval=None,
        metrics_file=None,
        trace_file=None,
        trace_iteration=None,
        megatron_lm=False,
        num_layers_per_virtual_pipeline_stage=1 if user.num_layers_per_virtual_pipeline_stage else None,
    )
    args.global_batch_size = args.micro_batch_size * verify.verify_data_parallel * 2 * pp
    chunks = _chunks(args)
    args.num_layers = pp * chunks
    derive_and_check(args)
    return args


def _chunks(args: argparse.Namespace) -> int:
    """Model chunks per rank of the user's schedule (or of megatron-core's interleaving)."""
    from ..megatron.args import schedule_settings

    settings = schedule_settings(args)
    if settings is not None:
        return settings.placement.chunks
    return args.virtual_pipeline_model_parallel_size or 1


def reference_of(args: argparse.Namespace) -> argparse.Namespace:
    """The same run with every zero-bubble flag at its default: megatron-core's own schedule."""
    from ..megatron.args import add_args
    from ..training.arguments import derive_and_check

    reference = copy.copy(args)
    for action in add_args(argparse.ArgumentParser(add_help=False))._actions:
        if action.dest != "help":
            setattr(reference, action.dest, action.default)
    derive_and_check(reference)
    return reference


def verify(user: argparse.Namespace, options: argparse.Namespace, inject: int | None = None) -> int:
    """Run both copies and print the report; 0 when they agree, 1 on a mismatch (ValueError: bad flags)."""
    theirs = scaled_copy(user, options)
    if theirs.zero_bubble is None:
        raise ValueError(NO_SCHEDULE)
    reference = reference_of(theirs)
    precision = "bf16" if theirs.bf16 else "fp16" if theirs.fp16 else "fp32"
    tolerance = options.verify_tolerance if options.verify_tolerance is not None else TOLERANCE[precision]
    print(_describe(theirs, precision), flush=True)
    with tempfile.TemporaryDirectory(prefix="megatron-zb-verify-") as folder:
        failed = _spawn(reference, theirs, Path(folder), inject)
        if failed:
            print(f"{PROG}: a rank failed:\n{failed}", file=sys.stderr)
            return 1
        ours, mine = _merge(Path(folder), "reference"), _merge(Path(folder), "theirs")
    verdict = compare(ours, mine, tolerance)
    note = "--use-distributed-optimizer shards the gradients" if theirs.use_distributed_optimizer else None
    print(report(verdict, ours, mine, theirs.zero_bubble.schedule, tolerance, note))
    return 0 if verdict.passed else 1


def _describe(args: argparse.Namespace, precision: str) -> str:
    microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    return (
        f"{PROG}: {args.zero_bubble.schedule} vs megatron-core's own schedule on a scaled-down copy: pipeline "
        f"{args.pipeline_model_parallel_size} x tensor {args.tensor_model_parallel_size} x data "
        f"{args.data_parallel_size} processes, {args.num_layers} layers, hidden {args.hidden_size}, sequence "
        f"{args.seq_length}, vocabulary {args.padded_vocab_size}, {microbatches} microbatches, "
        f"{args.train_iters} iterations, {precision}, dropout 0"
    )


def _spawn(reference: argparse.Namespace, theirs: argparse.Namespace, folder: Path, inject: int | None) -> str | None:
    """One set of gloo processes runs both copies; each rank writes what it measured to ``folder``."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from ..training.spawn import start_ranks

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        context = start_ranks(
            _worker, (reference, theirs, store.port, list(sys.path), str(folder), inject), theirs.world_size
        )
        while not context.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        return str(error)
    return None


def _worker(
    rank: int, launcher, reference, theirs, port: int, path: list[str], folder: str, inject: int | None
) -> None:
    launcher.apply()  # training.spawn.Launcher
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(theirs.world_size))
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    import torch
    import torch.distributed as dist

    from .. import cpu

    torch.set_num_threads(theirs.cpu_threads)
    cpu.enable()
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=theirs.world_size)
    try:
        found = {
            "reference": _run(reference, None),
            "theirs": _run(theirs, inject),
        }
        Path(folder, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, inject: int | None) -> dict:
    """Train one copy on this rank; its rows and, at the end, a checksum of every gradient it holds."""
    import torch

    from ..megatron.install import configure, install
    from ..process_groups import destroy_model_parallel
    from ..training.build import build, init_parallel
    from ..training.loop import train

    device = torch.device("cpu")
    install()
    configure(args.zero_bubble)
    init_parallel(args, device)
    try:
        trainee = build(args, device, gloo=True)
        if inject is not None:
            _inject_wrong_gradient(trainee, inject)
        rows = train(args, trainee)
        grads = {} if args.use_distributed_optimizer else _gradient_checksums(trainee)
    finally:
        destroy_model_parallel()
    keep = ("iteration", "loss", "grad_norm", "bubble_rate")
    return {"rows": [{key: row.get(key) for key in keep} for row in rows], "grads": grads}


def _inject_wrong_gradient(trainee, iteration: int) -> None:
    """Tests only: at ``iteration``, scale the first gradient of pipeline rank 0 by 1.01 before the step."""
    from megatron.core import parallel_state

    step, calls = trainee.optimizer.step, [0]

    def wrong_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == iteration and parallel_state.get_pipeline_model_parallel_rank() == 0:
            param = next(p for p in trainee.chunks[0].parameters() if p.requires_grad)
            param.main_grad.mul_(1.01)
        return step(*args, **kwargs)

    from .. import patching

    patching.replace(trainee.optimizer, "step", wrong_step, "verify-fault")  # this rank's run only


def _gradient_checksums(trainee) -> dict[str, list[float]]:
    """(norm, projection on a fixed random unit vector) of each gradient, by placement-independent name.

    The main gradients of the last iteration stay in DDP's buffers after the step. The key
    adds the tensor-parallel rank (both runs shard alike); data-parallel rank 0 reports, its
    gradients being the all-reduced ones.
    """
    import torch
    from megatron.core import parallel_state

    from ..megatron.init import placement_independent_names

    if parallel_state.get_data_parallel_rank() != 0:
        return {}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    found = {}
    for chunk in trainee.chunks:
        for name, param in placement_independent_names(chunk):
            grad = getattr(param, "main_grad", None)
            if grad is None:
                continue
            key = f"{name} (tensor rank {tp_rank})"
            seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "little")
            direction = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            flat = grad.detach().reshape(-1).double()
            found[key] = [float(flat.norm()), float(flat @ (direction / direction.norm()))]
    return found


def _merge(folder: Path, run: str) -> Run:
    merged = Run()
    for path in sorted(folder.glob("rank*.json")):
        found = json.loads(path.read_text())[run]
        for row in found["rows"]:
            if row["loss"] is not None:
                merged.losses[row["iteration"]] = row["loss"]
            if row["grad_norm"] is not None:
                merged.grad_norms[row["iteration"]] = row["grad_norm"]
        if path.name == "rank0.json":
            merged.bubbles = [row["bubble_rate"] for row in found["rows"] if row["bubble_rate"] is not None]
        merged.grads.update(found["grads"])
    return merged
