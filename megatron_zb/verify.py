"""``megatron-zb verify``: check a pretrain_gpt setting on CPU before spending GPU hours on it.

It takes the user's pretrain_gpt flags, shrinks the model (layers, hidden size, sequence,
vocabulary; dropout 0, mock data) but keeps the schedule, the pipeline and tensor-parallel
sizes, the precision and the optimizer flags, and trains the copy for a few iterations twice
in one set of gloo processes: once with megatron-core's own schedule, once with theirs. Both
start from the same weights (``placement_independent_init``), so losses, per-iteration grad
norms and per-parameter gradient checksums must agree; the report gives the largest relative
differences, the measured bubble of their schedule, and the first iteration that differs.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROG = "megatron-zb verify"
ITERATIONS = 4
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train a scaled-down copy of a pretrain_gpt setting on CPU with megatron-core's schedule and "
        "with yours; exit 1 when losses or gradients differ. Give your pretrain_gpt flags after these.",
        add_help=True,
    )
    parser.add_argument(
        "--verify-iters", type=int, default=ITERATIONS, help=f"iterations per run (default {ITERATIONS})"
    )
    parser.add_argument(
        "--verify-tolerance",
        type=float,
        default=None,
        help="largest relative difference accepted (default 1e-5 in fp32, 1e-2 with --bf16/--fp16)",
    )
    parser.add_argument(
        "--verify-data-parallel", type=int, default=1, help="data-parallel copies to run (default 1; processes)"
    )
    return parser


@dataclass
class Run:
    """What one run measured, merged over the ranks."""

    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    bubbles: list[float] = field(default_factory=list)
    grads: dict[str, list[float]] = field(default_factory=dict)  # key -> [norm, projection]


@dataclass
class Verdict:
    iterations: list[dict]
    max_loss: float
    max_grad_norm: float
    max_grad: float | None
    parameters: int
    first_difference: int | None
    reason: str


def scaled_copy(user: argparse.Namespace, verify: argparse.Namespace) -> argparse.Namespace:
    """The user's settings on a small model: what the schedule depends on is kept, the sizes shrink."""
    from .training.arguments import derive_and_check

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
    from .megatron.args import schedule_settings

    settings = schedule_settings(args)
    if settings is not None:
        return settings.placement.chunks
    return args.virtual_pipeline_model_parallel_size or 1


def reference_of(args: argparse.Namespace) -> argparse.Namespace:
    """The same run with every zero-bubble flag at its default: megatron-core's own schedule."""
    from .megatron.args import add_args
    from .training.arguments import derive_and_check

    reference = copy.copy(args)
    for action in add_args(argparse.ArgumentParser(add_help=False))._actions:
        if action.dest != "help":
            setattr(reference, action.dest, action.default)
    derive_and_check(reference)
    return reference


def main(argv: Sequence[str] | None = None, inject_wrong_gradient_at: int | None = None) -> int:
    """Run both copies and print the report; 0 when they agree, 1 on a mismatch, 2 on bad flags.

    ``inject_wrong_gradient_at`` (tests only) scales one gradient of their run at that
    iteration, before the optimizer step, to show that a wrong gradient is caught.
    """
    from .training.arguments import build_parser as train_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    verify, rest = parser.parse_known_args(argv)
    train = train_parser()
    train.prog = PROG
    user = train.parse_args(rest)
    try:
        if verify.verify_iters < 2:
            raise ValueError(f"--verify-iters must be at least 2, got {verify.verify_iters}")
        if verify.verify_data_parallel < 1:
            raise ValueError(f"--verify-data-parallel must be at least 1, got {verify.verify_data_parallel}")
        theirs = scaled_copy(user, verify)
        if theirs.zero_bubble is None:
            raise ValueError(
                "no megatron-zb schedule in these flags (e.g. --pipeline-schedule zb-v): there is nothing to "
                "compare with megatron-core's own schedule"
            )
        reference = reference_of(theirs)
    except ValueError as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    precision = "bf16" if theirs.bf16 else "fp16" if theirs.fp16 else "fp32"
    tolerance = verify.verify_tolerance if verify.verify_tolerance is not None else TOLERANCE[precision]
    print(_describe(theirs, precision), flush=True)
    with tempfile.TemporaryDirectory(prefix="megatron-zb-verify-") as folder:
        failed = _spawn(reference, theirs, Path(folder), inject_wrong_gradient_at)
        if failed:
            print(f"{PROG}: a rank failed:\n{failed}", file=sys.stderr)
            return 1
        ours, mine = _merge(Path(folder), "reference"), _merge(Path(folder), "theirs")
    verdict = compare(ours, mine, tolerance)
    print(report(verdict, mine, theirs.zero_bubble.schedule, tolerance))
    return 0 if verdict.first_difference is None else 1


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

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.spawn(
            _worker,
            args=(reference, theirs, store.port, list(sys.path), str(folder), inject),
            nprocs=theirs.world_size,
            join=True,
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        return str(error)
    return None


def _worker(rank: int, reference, theirs, port: int, path: list[str], folder: str, inject: int | None) -> None:
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(theirs.world_size))
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    import torch
    import torch.distributed as dist

    from . import cpu

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

    from .megatron.install import configure, install
    from .process_groups import destroy_model_parallel
    from .training.build import build, init_parallel
    from .training.loop import train

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

    trainee.optimizer.step = wrong_step


def _gradient_checksums(trainee) -> dict[str, list[float]]:
    """(norm, projection on a fixed random unit vector) of each gradient, by placement-independent name.

    The main gradients of the last iteration stay in DDP's buffers after the step. The key
    adds the tensor-parallel rank (both runs shard alike); data-parallel rank 0 reports, its
    gradients being the all-reduced ones.
    """
    import torch
    from megatron.core import parallel_state

    from .megatron.init import placement_independent_names

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


def relative(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    return abs(value - reference) / max(abs(reference), 1e-30)


def compare(reference: Run, theirs: Run, tolerance: float) -> Verdict:
    """Per-iteration loss and grad-norm differences, then the final per-parameter gradient checksums."""
    iterations, first, reason = [], None, ""
    for iteration in sorted(reference.losses.keys() | reference.grad_norms.keys()):
        loss = _difference(reference.losses.get(iteration), theirs.losses.get(iteration))
        norm = _difference(reference.grad_norms.get(iteration), theirs.grad_norms.get(iteration))
        iterations.append({"iteration": iteration, "loss": loss, "grad_norm": norm})
        if first is None and max(loss, norm) > tolerance:
            first = iteration
            what = "loss" if loss > tolerance else "grad norm"
            reason = f"{what} differs by {max(loss, norm):.2e} relative"
    worst_grad, worst_key = None, None
    if reference.grads:
        worst_grad = 0.0
        for key, (norm, projection) in reference.grads.items():
            if key not in theirs.grads:
                worst_grad, worst_key = float("inf"), key
                break
            mine = theirs.grads[key]
            scale = max(norm, 1e-30)
            difference = (
                max(abs(mine[0] - norm), abs(mine[1] - projection)) / scale if mine != [norm, projection] else 0.0
            )
            if difference > worst_grad:
                worst_grad, worst_key = difference, key
        if first is None and worst_grad > tolerance:
            first = max(reference.grad_norms or reference.losses)
            reason = f"the gradient of {worst_key} differs by {worst_grad:.2e} relative"
    return Verdict(
        iterations=iterations,
        max_loss=max((row["loss"] for row in iterations), default=0.0),
        max_grad_norm=max((row["grad_norm"] for row in iterations), default=0.0),
        max_grad=worst_grad,
        parameters=len(reference.grads),
        first_difference=first,
        reason=reason,
    )


def _difference(reference: float | None, theirs: float | None) -> float:
    if reference is None and theirs is None:
        return 0.0
    if reference is None or theirs is None:
        return float("inf")
    return relative(theirs, reference)


def report(verdict: Verdict, theirs: Run, schedule: str, tolerance: float) -> str:
    lines = [f"{'iteration':>9}  {'loss rel. diff':>14}  {'grad norm rel. diff':>19}"]
    lines += [f"{row['iteration']:>9}  {row['loss']:>14.2e}  {row['grad_norm']:>19.2e}" for row in verdict.iterations]
    lines.append(f"max relative loss difference: {verdict.max_loss:.2e}")
    lines.append(f"max relative grad-norm difference: {verdict.max_grad_norm:.2e}")
    if verdict.max_grad is None:
        lines.append("per-parameter gradient checksums: not taken (--use-distributed-optimizer shards the gradients)")
    else:
        lines.append(
            f"max relative gradient difference ({verdict.parameters} parameter checksums, last iteration): "
            f"{verdict.max_grad:.2e}"
        )
    if theirs.bubbles:
        lines.append(f"measured bubble ({schedule}): {100 * sum(theirs.bubbles) / len(theirs.bubbles):.1f}%")
    if verdict.first_difference is None:
        lines.append(f"OK: {schedule} matches megatron-core's schedule within {tolerance:.0e} relative")
    else:
        lines.append(
            f"MISMATCH at iteration {verdict.first_difference}: {verdict.reason} (tolerance {tolerance:.0e}); "
            f"{schedule} does not train like megatron-core's schedule here"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
