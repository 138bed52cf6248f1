"""``megatron-zb train --megatron-lm [PATH]``: the launcher of Megatron-LM's own ``pretrain()``.

Under torchrun or srun each process runs ``pretrain.pretrain_here``. With ``--cpu`` this command checks the line
before any process starts (``preflight.py``) and spawns the gloo ranks itself (``cpu.py`` shims what Megatron-LM
assumes of a GPU); they are forks of a server that imported Megatron-LM's loop once (``rank_imports.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from ..flags.launcher import LAUNCHER_FLAGS, MEGATRON_LM_LAUNCHER
from ..flags.table import add_to
from ..training.checks import check_megatron_lm_launch
from . import preflight
from .checkout import MegatronLMMissing, uses_own_providers
from .pretrain import pretrain_here


def launcher_parser() -> argparse.ArgumentParser:
    """The flags this launcher reads itself (their rows in flags/launcher.py); the rest go to Megatron-LM's parser."""
    parser = argparse.ArgumentParser(prog="megatron-zb train --megatron-lm", add_help=False, allow_abbrev=False)
    return add_to(parser, _rows(MEGATRON_LM_LAUNCHER))


def _rows(options: Sequence[str]) -> list:
    rows = {row.option: row for row in LAUNCHER_FLAGS}
    return [replace(rows[option], group="") for option in options]


def split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our launcher flags, Megatron-LM's flags). ``--megatron-lm PATH`` takes PATH only when it is a directory."""
    argv = list(argv)
    if "--megatron-lm" in argv:
        at = argv.index("--megatron-lm")
        if at + 1 < len(argv) and not argv[at + 1].startswith("-") and not os.path.isdir(argv[at + 1]):
            raise MegatronLMMissing(f"--megatron-lm {argv[at + 1]}: not a directory (give a Megatron-LM checkout)")
        if at + 1 >= len(argv) or argv[at + 1].startswith("-"):
            argv.insert(at + 1, "")
    return launcher_parser().parse_known_args(argv)


def run(argv: Sequence[str]) -> int:
    launch, rest = split_argv(argv)
    try:
        check_megatron_lm_launch(launch)
    except ValueError as error:
        print(f"megatron-zb train: error: {error}", file=sys.stderr)
        return 2
    if launch.megatron_lm:
        os.environ["MEGATRON_LM_PATH"] = os.path.abspath(launch.megatron_lm)
    if launch.cpu:
        own_providers = uses_own_providers()  # imports the checkout's megatron.training (or the installed one)
        unset = preflight.unset_te_attention()  # before the checks, which unset them too
        if unset:
            print(f"megatron-zb train: on CPU: {unset}", file=sys.stderr)
        try:
            world = _world_size(launch, rest)
            checked = preflight.check(rest, world, own_providers)
        except ValueError as error:
            print(f"megatron-zb train: error: {error}", file=sys.stderr)
            return 2
        for setting in checked.dropped:
            print(f"megatron-zb train: on CPU: {setting.flag} left out ({setting.why})", file=sys.stderr)
        for setting in checked.additions:
            value = setting.flag if setting.value is None else f"{setting.flag} {setting.value}"
            print(f"megatron-zb train: on CPU: {value} ({setting.why})", file=sys.stderr)
        return _spawn_cpu(launch, checked.line(), world, checked.timeout_s)
    pretrain_here(rest, launch.metrics_file)
    return 0


def _world_size(launch: argparse.Namespace, argv: Sequence[str]) -> int:
    sizes = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_to(sizes, _rows(("--tensor-model-parallel-size", "--pipeline-model-parallel-size")))
    found, _ = sizes.parse_known_args(argv)
    model_parallel = found.tensor_model_parallel_size * found.pipeline_model_parallel_size
    procs = launch.cpu_procs or model_parallel
    if procs < 1 or procs % model_parallel:
        raise ValueError(
            f"--cpu-procs {procs} does not split into tensor x pipeline = {model_parallel} groups; use a multiple "
            f"of {model_parallel}"
        )
    return procs


def cpu_argv(argv: Sequence[str]) -> list[str]:
    """Megatron-LM's flags with what a CPU run needs added where the command line does not give the flag."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return [*argv, *preflight.setting_argv([s for s in preflight.CPU_SETTINGS if s.flag not in given])]


def _spawn_cpu(launch: argparse.Namespace, worker_argv: Sequence[str], world: int, timeout_s: float) -> int:
    return spawn_cpu(worker_argv, world, launch.metrics_file, launch.cpu_threads, timeout_s)


def spawn_cpu(
    argv: Sequence[str],
    processes: int,
    metrics_file: str | None = None,
    threads: int = 1,
    timeout_s: float = 600.0,
    deadline_s: float | None = None,
) -> int:
    """Run ``pretrain()`` with ``argv`` on ``processes`` gloo ranks spawned and supervised here; the exit code.

    ``argv`` is taken as checked and complete for the CPU (``preflight.check`` and its additions);
    ``timeout_s`` is its --distributed-timeout-minutes: every rank publishes its heartbeat, and a stalled rank
    is named as for megatron-zb's own loop (``training.supervise``); ``deadline_s`` bounds the whole run.
    """
    import torch.distributed as dist

    from ..training.spawn import start_ranks
    from ..training.supervise import caught_signals, failure_of, supervise

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    copies = _megatron_copies()
    with caught_signals() as received:
        arguments = (processes, store.port, threads, list(argv), metrics_file, list(sys.path), timeout_s, copies)
        context = start_ranks(_cpu_worker, arguments, processes, ("megatron_zb.megatron_lm.rank_imports",))
        failure = lambda rank: failure_of(context, rank)  # noqa: E731
        return supervise(context.processes, store, failure, received, timeout_s=timeout_s, deadline_s=deadline_s)


def _megatron_copies() -> dict[str, str]:
    """Where this process's megatron.core and megatron.training come from (the ranks must use the same)."""
    return {name: getattr(sys.modules.get(name), "__file__", None) for name in ("megatron.core", "megatron.training")}


def _same_megatron(copies: dict[str, str]) -> None:
    """Refuse a rank whose fork server imported another megatron than its launcher (a server outlives a run:
    a second run from one process, with another checkout first on ``sys.path``, would mix the two)."""
    for name, launcher in copies.items():
        module = sys.modules.get(name)
        if launcher is not None and module is not None and module.__file__ != launcher:
            raise RuntimeError(
                f"this rank's fork server imported {name} from {module.__file__}, its launcher uses {launcher}: "
                "run each Megatron-LM checkout from its own process"
            )


def _cpu_worker(
    rank: int,
    launcher,
    world: int,
    port: int,
    threads: int,
    argv: list[str],
    metrics_file: str | None,
    path: list[str],
    timeout_s: float,
    copies: dict[str, str],
) -> None:
    launcher.apply()  # training.spawn.Launcher: the environment and the log (verify's) of this run
    sys.path[:] = path
    _same_megatron(copies)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..training.supervise import store_publisher
    from ..training.watchdog import RankWatchdog, heartbeat_interval
    from . import cpu

    torch.set_num_threads(threads)
    # Under torchrun the ranks' DataLoader workers fork; here the ranks were spawned, and spawning
    # workers cannot pickle Megatron-LM's local worker_init_fn (core_v0.19.0, --num-workers > 0).
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    cpu.set_environment()
    cpu.enable()
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    publisher = dist.TCPStore("127.0.0.1", port, is_master=False)
    watchdog = RankWatchdog(rank, timeout_s, store_publisher(publisher, rank), interval_s=heartbeat_interval(timeout_s))
    watchdog.start()
    error = None
    try:
        pretrain_here(argv, metrics_file)
    except SystemExit as stop:
        problem = early_exit_problem(stop.code, argv)
        if problem is not None:
            error = RuntimeError(problem)
            raise error from None
    except BaseException as failed:
        error = failed
        raise
    finally:
        watchdog.stop(error)
        if dist.is_initialized():
            dist.destroy_process_group()


# Megatron-LM's train() ends with sys.exit() (status 0) when one of these was reached.
EXIT_FLAGS = ("--exit-interval", "--exit-duration-in-mins", "--exit-signal-handler")


def early_exit_problem(code: object, argv: Sequence[str]) -> str | None:
    """Why a ``sys.exit(code)`` inside ``pretrain()`` is a failure, or None when it was asked for.

    Megatron-LM also exits with status 0 where it gives up: ``load_checkpoint`` on RNG state it
    cannot restore prints "Unable to load rng state ... exiting" and calls ``sys.exit()``. Only the
    exit conditions of its ``--exit-*`` flags end a run on purpose.
    """
    if code not in (None, 0):
        return f"Megatron-LM exited: {code}"
    given = {arg.split("=", 1)[0] for arg in argv}
    if given & set(EXIT_FLAGS):
        return None
    return (
        "Megatron-LM called sys.exit() before pretrain() returned, without any of "
        f"{', '.join(EXIT_FLAGS)} on the command line: it gave up (its last message above says why)"
    )
