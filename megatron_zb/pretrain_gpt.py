"""``python -m megatron_zb.pretrain_gpt`` / ``megatron-zb train``: GPT pretraining on megatron-core.

Megatron-LM's pretrain_gpt flags (a subset, same names) plus the zero-bubble flags. Under
torchrun or srun every process runs one rank on its GPU with NCCL; with ``--cpu`` this
command spawns the gloo processes itself, so a laptop can run the same job.

By default this is megatron-zb's own training loop (mock data, Megatron-LM-style log lines).
With ``--megatron-lm`` and a Megatron-LM checkout importable, it runs Megatron-LM's
``pretrain()`` instead (real datasets, its logging and checkpoints) with the same
zero-bubble flags; see ``megatron_zb.megatron_lm``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

log = logging.getLogger("megatron_zb.train")


def main(argv: Sequence[str] | None = None) -> int:
    from .training.arguments import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--megatron-lm" in argv:
        from .megatron_lm import MegatronLMMissing, run

        try:
            return run([arg for arg in argv if arg != "--megatron-lm"])
        except MegatronLMMissing as error:
            print(f"megatron-zb train: {error}", file=sys.stderr)
            return 2
    args = parse(argv)
    if args.cpu:
        return _spawn_cpu(args)
    return _run_under_launcher(args)


def _spawn_cpu(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # The rendezvous store lives here for the whole run: its port cannot be taken meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    try:
        mp.spawn(_cpu_worker, args=(args, port, list(sys.path)), nprocs=args.world_size, join=True)
    except mp.ProcessRaisedException as error:
        print(f"megatron-zb train: a rank failed:\n{error}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as error:
        print(f"megatron-zb train: {error}", file=sys.stderr)
        return 1
    return 0


def _cpu_worker(rank: int, args: argparse.Namespace, port: int, path: list[str]) -> None:
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world_size))
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "Apex is not installed", ...
    import torch
    import torch.distributed as dist

    from . import cpu

    torch.set_num_threads(args.cpu_threads)
    cpu.enable()
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world_size)
    _configure_logging()
    try:
        run_rank(args, torch.device("cpu"), gloo=True)
    finally:
        dist.destroy_process_group()


def _run_under_launcher(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        print(
            "megatron-zb train: no launcher environment (RANK, WORLD_SIZE): run under torchrun or srun on GPU "
            "nodes, or add --cpu to spawn gloo processes here",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("megatron-zb train: no GPU visible to this process; add --cpu to train on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group(args.distributed_backend, device_id=device)
    _configure_logging()
    try:
        run_rank(args, device, gloo=args.distributed_backend == "gloo")
    finally:
        dist.destroy_process_group()
    return 0


def run_rank(args: argparse.Namespace, device, gloo: bool) -> list[dict]:
    """Train this rank (process group already up); returns the per-iteration rows it logged."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from .megatron.install import configure, install
    from .training.build import build, init_parallel
    from .training.loop import train

    if dist.get_rank() == 0:
        _log_setup(args)
    install()
    configure(args.zero_bubble)
    init_parallel(args, device)
    try:
        return train(args, build(args, device, gloo))
    finally:
        parallel_state.destroy_model_parallel()


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    logging.getLogger("megatron_zb").setLevel(logging.INFO)


def _log_setup(args: argparse.Namespace) -> None:
    schedule = args.zero_bubble.schedule if args.zero_bubble else "megatron-core's own"
    log.info(
        "training %d layers (hidden %d) on %d process(es): pipeline %d x tensor %d x data %d, %s placement; "
        "schedule %s, %d microbatches per iteration",
        args.num_layers,
        args.hidden_size,
        args.world_size,
        args.pipeline_model_parallel_size,
        args.tensor_model_parallel_size,
        args.data_parallel_size,
        args.placement.kind,
        schedule,
        args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
    )


if __name__ == "__main__":
    sys.exit(main())
