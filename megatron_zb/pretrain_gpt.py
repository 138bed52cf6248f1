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
from collections.abc import Callable, Sequence
from datetime import timedelta

from .training.spawn import Launcher, start_ranks

log = logging.getLogger("megatron_zb.train")
STARTUP_TIMEOUT = timedelta(minutes=5)  # for every rank to import and connect, whatever the group timeout


def main(argv: Sequence[str] | None = None) -> int:
    """``megatron-zb train``; Ctrl-C before the ranks start ends it with status 130 and one line, no traceback.

    Once the ranks run, the launcher's signal handling ends them all (``watchdog.supervise``), also with 130.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("megatron-zb train: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    from .training.arguments import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--megatron-lm" in argv:
        from .megatron_lm.checkout import MegatronLMMissing
        from .megatron_lm.launch import run

        try:
            return run(argv)
        except MegatronLMMissing as error:
            print(f"megatron-zb train: {error}", file=sys.stderr)
            return 2
    args = parse(argv)
    if args.cpu:
        return _spawn_cpu(args)
    return _run_under_launcher(args)


def _spawn_cpu(args: argparse.Namespace, worker: Callable | None = None) -> int:
    """Spawn the gloo ranks and supervise them (timeouts reported by name, SIGINT/SIGTERM end all).

    ``worker`` replaces ``_cpu_worker`` (same arguments), for tests that inject faults.
    """
    import torch.distributed as dist

    from .training.supervise import caught_signals, failure_of, supervise

    # The rendezvous store lives here for the whole run: its port cannot be taken meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with caught_signals() as received:  # from here on SIGINT/SIGTERM end the ranks, never orphan them
        context = start_ranks(worker or _cpu_worker, (args, store.port, list(sys.path)), args.world_size)
        failure = lambda rank: failure_of(context, rank)  # noqa: E731
        timeout_s = distributed_timeout(args).total_seconds()
        return supervise(context.processes, store, failure, received, timeout_s=timeout_s)


def _cpu_worker(rank: int, launcher: Launcher, args: argparse.Namespace, port: int, path: list[str]) -> None:
    launcher.apply()
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world_size))
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "Apex is not installed", ...
    import torch
    import torch.distributed as dist

    from . import cpu
    from .training.supervise import store_publisher

    torch.set_num_threads(args.cpu_threads)
    cpu.enable()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STARTUP_TIMEOUT)
    _all_started(store, rank, args.world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=args.world_size, timeout=distributed_timeout(args)
    )
    _configure_logging()
    publisher = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STARTUP_TIMEOUT)
    try:
        run_rank(args, torch.device("cpu"), gloo=True, publish=store_publisher(publisher, rank))
    finally:
        dist.destroy_process_group()


def _all_started(store, rank: int, world_size: int) -> None:
    """Wait for every rank's imports (seconds each, uneven) before the group starts counting its timeout."""
    if store.add("megatron_zb/started", 1) == world_size:
        store.set("megatron_zb/all_started", "1")
    store.wait(["megatron_zb/all_started"], STARTUP_TIMEOUT)


def distributed_timeout(args: argparse.Namespace) -> timedelta:
    """``--distributed-timeout-minutes`` as the timeout of every process group."""
    return timedelta(minutes=args.distributed_timeout_minutes)


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
    dist.init_process_group(args.distributed_backend, device_id=device, timeout=distributed_timeout(args))
    _configure_logging()
    try:
        # No common parent here: each rank logs its own status once it waits past the timeout.
        run_rank(args, device, gloo=args.distributed_backend == "gloo", publish=None)
    finally:
        dist.destroy_process_group()
    return 0


def run_rank(args: argparse.Namespace, device, gloo: bool, publish: Callable[[dict], None] | None = None) -> list[dict]:
    """Train this rank (process group already up); returns the per-iteration rows it logged.

    A ``RankWatchdog`` names what the rank waits for while it trains; ``publish`` receives its
    status records (the launcher's store with ``--cpu``), or, with None, the rank logs its own.
    """
    import torch.distributed as dist

    from .megatron.install import configure, install
    from .process_groups import destroy_model_parallel
    from .training.build import build, init_parallel
    from .training.loop import train
    from .training.watchdog import RankWatchdog, heartbeat_interval

    if dist.get_rank() == 0:
        _log_setup(args)
    install()
    configure(args.zero_bubble)
    init_parallel(args, device)
    try:
        trainee = build(args, device, gloo)
        timeout_s = distributed_timeout(args).total_seconds()
        watchdog = RankWatchdog(dist.get_rank(), timeout_s, publish, interval_s=heartbeat_interval(timeout_s))
        watchdog.start()
        try:
            rows = train(args, trainee)
        except BaseException as error:
            watchdog.stop(error)
            raise
        watchdog.stop()
        return rows
    finally:
        destroy_model_parallel()


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
