"""Megatron-LM's own ``pretrain()`` with the zero-bubble flags: ``megatron-zb train --megatron-lm [PATH]``.

Needs a Megatron-LM checkout (PATH, MEGATRON_LM_PATH, or its root on PYTHONPATH; with
MEGATRON_LM_USE_INSTALLED=1 the installed megatron-core >= 0.17 wheel's own ``megatron/training``
and megatron-core are used, the checkout only for its scripts): its
``pretrain_gpt.py`` supplies the datasets, model provider and forward step, its ``pretrain()``
the loop, logging and checkpoints; we add our flags, register the schedule behind
``get_forward_backward_func()`` and check the flags before any process group starts. Both
``pretrain()`` signatures are driven: up to Megatron-LM 0.17 it parses the flags itself
(``args_defaults=``, ``extra_args_provider=``); from 0.18 it takes a config container first,
built by the script from ``parse_and_validate_args()``, as pretrain_gpt.py's ``__main__`` does.

With ``--cpu`` this command spawns the gloo processes itself (``megatron_zb.megatron_lm_cpu``
shims what Megatron-LM assumes of a GPU). V-shape schedules run here too: Megatron-LM's model
building, data loading and embedding group assume megatron's looping placement, and
``megatron_zb.megatron.placement_hooks`` (installed with ``install()``, set up by the wrapped
``validate_args``) gives them the V's answers: two chunks per rank, the embedding and the loss
on rank 0's chunks, their data and tied embedding copies there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import os
import sys
import time
from collections.abc import Sequence
from functools import partial

from . import megatron_lm_preflight as preflight
from .megatron import patching
from .megatron.args import add_args, schedule_settings, zero_bubble_notes
from .megatron.placement_hooks import prepare_args
from .training.checks import check_megatron_lm_launch, writable_file

_CHECKOUT_MODULES = ("megatron", "pretrain_gpt", "gpt_builders", "model_provider")


class MegatronLMMissing(RuntimeError):
    """No importable Megatron-LM checkout, or a package it needs is not installed."""


def launcher_parser() -> argparse.ArgumentParser:
    """The flags this launcher reads itself; the rest go to Megatron-LM's parser unchanged."""
    parser = argparse.ArgumentParser(prog="megatron-zb train --megatron-lm", add_help=False, allow_abbrev=False)
    parser.add_argument("--megatron-lm", nargs="?", const="", default=None, metavar="PATH")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--cpu-procs", type=int, default=None)
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--metrics-file", default=None)
    return parser


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
        for setting in checked.additions:
            value = setting.flag if setting.value is None else f"{setting.flag} {setting.value}"
            print(f"megatron-zb train: on CPU: {value} ({setting.why})", file=sys.stderr)
        return _spawn_cpu(launch, [*rest, *preflight.setting_argv(checked.additions)], world, checked.timeout_s)
    pretrain_here(rest, launch.metrics_file)
    return 0


def pretrain_here(argv: Sequence[str], metrics_file: str | None = None) -> None:
    """Run Megatron-LM's pretrain() in this process (torch.distributed set up by it, or already)."""
    script = _pretrain_gpt_module()
    from megatron.training import training

    from .megatron.install import install

    install()
    check_flags_before_init()
    try:
        if metrics_file:
            _write_metrics(training, metrics_file)
        _pretrain(script, training, argv)
    finally:
        patching.undo(patching.MEGATRON_LM)  # the metrics hook is this run's


def _pretrain(script, training, argv: Sequence[str]) -> None:
    from megatron.core.enums import ModelType

    sys.argv = [getattr(script, "__file__", "pretrain_gpt.py"), *argv]
    datasets = script.train_valid_test_datasets_provider
    patching.replace(datasets, "is_distributed", True, patching.MEGATRON_LM)  # as pretrain_gpt.py's __main__ sets it
    extra = {}
    if getattr(script, "get_embedding_ranks", None) is not None:
        extra["get_embedding_ranks"] = script.get_embedding_ranks
    if takes_config_container(training.pretrain):
        config = _config_container(script)
        training.pretrain(config, datasets, ModelType.encoder_or_decoder, script.forward_step, **extra)
        return
    training.pretrain(
        datasets,
        _model_provider(script),
        ModelType.encoder_or_decoder,
        script.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_args,
        **extra,
    )


def takes_config_container(pretrain) -> bool:
    """Megatron-LM >= 0.18: ``pretrain(cfg_container, datasets, model_type, forward_step, ...)``."""
    return next(iter(inspect.signature(pretrain).parameters), None) == "cfg_container"


def _config_container(script):
    """What pretrain_gpt.py's ``__main__`` builds before calling a config-container pretrain()."""
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    return pretrain_cfg_container_from_args(args, gpt_config_from_args(args))


def _pretrain_gpt_module():
    """The checkout's pretrain_gpt.py; with no checkout, the installed ``megatron.training`` and our providers."""
    root = os.environ.get("MEGATRON_LM_PATH")
    if root and root not in sys.path:
        if os.environ.get("MEGATRON_LM_USE_INSTALLED") == "1":
            sys.path.append(root)  # the installed megatron.core/megatron.training win; the checkout's scripts
        else:
            sys.path.insert(0, root)
    try:
        importlib.import_module("megatron.training")
    except ImportError as error:
        raise _missing(error, root) from None
    try:
        return importlib.import_module("pretrain_gpt")
    except ImportError as error:
        if root or getattr(error, "name", None) != "pretrain_gpt":
            raise _missing(error, root) from None
    from . import megatron_lm_script

    return megatron_lm_script


def uses_own_providers() -> bool:
    """No checkout: the installed megatron-core's ``megatron.training`` runs with ``megatron_lm_script``'s providers."""
    from . import megatron_lm_script

    return _pretrain_gpt_module() is megatron_lm_script


def _missing(error: ImportError, root: str | None) -> MegatronLMMissing:
    """Name a missing package as such; only a missing ``megatron.training`` or script means no checkout."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    if name and name not in _CHECKOUT_MODULES:
        return MegatronLMMissing(
            f"Megatron-LM needs the package '{name}', which is not installed ({error}); install Megatron-LM's "
            "pure-Python dependencies with `pip install 'megatron-zb[megatron-lm]'`"
        )
    where = f"MEGATRON_LM_PATH={root} has none" if root else "none found"
    return MegatronLMMissing(
        f"--megatron-lm needs a Megatron-LM checkout (megatron.training and pretrain_gpt.py): give its path "
        f"(--megatron-lm PATH), set MEGATRON_LM_PATH or put it on PYTHONPATH; {where} ({error}). Without it, drop "
        "--megatron-lm to use megatron-zb's own loop"
    )


def _model_provider(script):
    """The provider pretrain_gpt.py passes to pretrain(), in the older and the newer layout."""
    builder = getattr(script, "gpt_builder", None)
    if builder is not None:
        return partial(script.model_provider, builder)
    return script.model_provider


def check_flags_before_init() -> None:
    """Refuse bad zero-bubble flags in Megatron-LM's ``validate_args``, before torch.distributed starts.

    Otherwise they fail at the first ``get_forward_backward_func()`` call, on every rank, after
    the process groups, model and optimizer were built. For a placement megatron does not build
    itself (V) it also sets the arguments Megatron-LM builds the chunks from
    (``placement_hooks.prepare_args``). Wraps the ``validate_args`` that
    ``initialize_megatron`` calls right after parsing, and the one in ``megatron.training.arguments``
    where newer checkouts parse before ``pretrain()``; calling this again does nothing.
    """
    from megatron.training import initialize

    with contextlib.suppress(ImportError):
        importlib.import_module("megatron.training.arguments")
    modules = [initialize, sys.modules.get("megatron.training.arguments")]
    for module in modules:
        validate_args = getattr(module, "validate_args", None)
        if validate_args is not None and not getattr(validate_args, "megatron_zb_checked", False):
            patching.replace(module, "validate_args", _checked(validate_args), patching.MEGATRON)


def _checked(validate_args):
    """Megatron-LM's validate_args, then ours: runs before torch.distributed is initialised."""

    def validate(args, *rest, **kwargs):
        found = validate_args(args, *rest, **kwargs)
        checked = found if found is not None else args
        try:
            check_zero_bubble(checked)
        except ValueError as error:
            raise SystemExit(f"megatron-zb: {error}") from None
        if getattr(checked, "rank", 0) == 0:
            for note in zero_bubble_notes(checked):
                print(f"megatron-zb: note: {note}", file=sys.stderr, flush=True)
        return found

    validate.megatron_zb_checked = True
    return validate


def check_zero_bubble(args: argparse.Namespace) -> None:
    """megatron-zb's checks of Megatron-LM's validated arguments; sets what a foreign placement needs (V)."""
    settings = schedule_settings(args)
    if settings is None:
        return
    if settings.costs_file:
        writable_file("--zero-bubble-save-costs", settings.costs_file)
    if len(settings.placements) > 1:
        raise ValueError(
            f"{settings.schedule} runs {len(settings.placements)} pipelines in opposite directions; Megatron-LM's "
            "get_model builds one: run it with `megatron-zb train` (megatron-zb's own training loop)"
        )
    prepare_args(args, settings.placement, settings.schedule)


def _write_metrics(training, path: str) -> None:
    """``--metrics-file``: one JSON line per iteration from Megatron-LM's ``training_log`` (logging rank only).

    Recorded under the ``megatron-lm`` scope, which ``pretrain_here`` undoes when its run returns.
    """
    original = training.training_log
    if getattr(original, "megatron_zb_metrics", False):
        return
    from .megatron.install import active_settings
    from .training.measured import MetricsWriter

    writer = MetricsWriter(path)
    last = [time.perf_counter()]

    @functools.wraps(original)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        now = time.perf_counter()
        settings = active_settings()
        loss = loss_dict.get("lm loss") if loss_dict else None
        grad_norm = rest[3] if len(rest) > 3 else kwargs.get("grad_norm")
        skipped = rest[2] if len(rest) > 2 else kwargs.get("skipped_iter")
        writer.write(
            iteration,
            None if loss is None else float(loss),
            now - last[0],
            None,
            settings.schedule if settings is not None else "megatron-core",
            grad_norm=None if grad_norm is None else float(grad_norm),
            learning_rate=None if learning_rate is None else float(learning_rate),
            skipped=bool(skipped),
        )
        last[0] = now
        return original(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)

    training_log.megatron_zb_metrics = True
    patching.replace(training, "training_log", training_log, patching.MEGATRON_LM)


def _world_size(launch: argparse.Namespace, argv: Sequence[str]) -> int:
    sizes = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    sizes.add_argument("--tensor-model-parallel-size", type=int, default=1)
    sizes.add_argument("--pipeline-model-parallel-size", type=int, default=1)
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

    from .pretrain_gpt import start_ranks
    from .training.supervise import caught_signals, failure_of, supervise

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    copies = _megatron_copies()
    with caught_signals() as received:
        arguments = (processes, store.port, threads, list(argv), metrics_file, list(sys.path), timeout_s, copies)
        context = start_ranks(_cpu_worker, arguments, processes, ("megatron_zb.megatron_lm_rank_imports",))
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
    launcher.apply()  # pretrain_gpt.Launcher: the environment and the log (verify's) of this run
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

    from . import megatron_lm_cpu
    from .training.supervise import store_publisher
    from .training.watchdog import RankWatchdog, heartbeat_interval

    torch.set_num_threads(threads)
    # Under torchrun the ranks' DataLoader workers fork; here the ranks were spawned, and spawning
    # workers cannot pickle Megatron-LM's local worker_init_fn (core_v0.19.0, --num-workers > 0).
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    megatron_lm_cpu.set_environment()
    megatron_lm_cpu.enable()
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
