"""Test-only faults for the watchdog: one rank stalls (sleeps, or is stopped by SIGSTOP) at a chosen point.

``python -m megatron_zb.testing.stall FAULT <megatron-zb train flags>`` runs the CPU launcher with
``stalling_worker``, which installs the fault on its rank and then runs the normal worker (with
``--megatron-lm`` in the flags: Megatron-LM's ``pretrain()`` through ``megatron_lm.launch.spawn_cpu``). FAULT is
JSON: ``rank``, ``at`` (one of ``STALL_POINTS``), ``iteration``, ``how`` ("sleep", the default, or "sigstop":
the process stops itself, its heartbeat thread with it), ``seconds`` to sleep, ``mark`` (a file that gets
the wall time the stall began) and, by point: ``match`` for ``pass`` ("F s2 mb3") and ``send`` ("activation
of F s1 mb2"), ``call`` for ``forward`` (the how-many-th model forward of the iteration, from 1). ``timeout_s``
sets ``--distributed-timeout-minutes`` in seconds. Nothing in the package calls this module.

``forward`` hooks megatron-core's ``GPTModel.forward``, so it stalls under any schedule: megatron-zb's,
megatron-core's own, and Megatron-LM's ``pretrain()``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence

from .. import patching

SCOPE = "stall"  # the faults this rank installed (it ends with its run)

STALL_POINTS = ("grad-norm", "save", "pass", "send", "forward")
HOW = ("sleep", "sigstop")


def stalling_worker(rank: int, launcher, args: argparse.Namespace, port: int, path: list[str]) -> None:
    sys.path[:] = path
    from ..pretrain_gpt import _cpu_worker

    fault = args.test_stall
    if fault["rank"] == rank:
        _install(fault)
    _cpu_worker(rank, launcher, args, port, path)


def stalling_megatron_lm_worker(fault: dict, rank: int, *args) -> None:
    """``megatron_lm.launch._cpu_worker``'s arguments after ``fault``; the fault installed on its rank first."""
    sys.path[:] = args[6]  # the parent's path, as the worker sets it (after the environment, world, ...)
    from ..megatron_lm.launch import _cpu_worker

    if fault["rank"] == rank:
        _install(fault)
    _cpu_worker(rank, *args)


def _stall(fault: dict) -> None:
    with open(fault["mark"], "w") as file:
        file.write(repr(time.time()))
    if fault.get("how", "sleep") == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: the heartbeat too
    time.sleep(fault.get("seconds", 120))


def _now_iteration() -> int | None:
    from ..training.watchdog import _loop_iteration

    return _loop_iteration(sys._getframe())


def _install(fault: dict) -> None:
    at, iteration = fault["at"], fault["iteration"]
    if at == "grad-norm":  # inside optimizer.step(), before the grad-norm all-reduce
        from megatron.core.optimizer import optimizer

        norm = optimizer.get_grad_norm_fp32

        def stalled_norm(*args, **kwargs):
            if _now_iteration() == iteration:
                _stall(fault)
            return norm(*args, **kwargs)

        patching.replace(optimizer, "get_grad_norm_fp32", stalled_norm, SCOPE)
    elif at == "save":  # before this rank writes its files (the others wait in the save's barrier)
        from ..training import checkpoint

        save = checkpoint.save_checkpoint

        def stalled_save(directory, at_iteration, *args, **kwargs):
            if at_iteration == iteration:
                _stall(fault)
            return save(directory, at_iteration, *args, **kwargs)

        patching.replace(checkpoint, "save_checkpoint", stalled_save, SCOPE)
    elif at == "pass":  # computing a forward pass, e.g. "F s2 mb3"
        from ..runtime import steps
        from ..runtime.activity import activity

        forward = steps.forward

        def stalled_forward(*args, **kwargs):
            if str(activity.current_pass) == fault["match"] and _now_iteration() == iteration:
                _stall(fault)
            return forward(*args, **kwargs)

        steps.forward = stalled_forward
    elif at == "send":  # in the P2P layer, about to post a send, e.g. "activation of F s1 mb2"
        from ..runtime.p2p import PipeComm

        post = PipeComm.post

        def stalled_post(self, recvs, sends):
            if any(fault["match"] in t.what for t, _ in sends) and _now_iteration() == iteration:
                _stall(fault)
            return post(self, recvs, sends)

        patching.replace(PipeComm, "post", stalled_post, SCOPE)
    elif at == "forward":  # the call-th model forward of the iteration, under any schedule
        _install_forward(fault, iteration)
    else:
        raise ValueError(f"stall point {at!r}: use one of {', '.join(STALL_POINTS)}")


def _install_forward(fault: dict, iteration: int) -> None:
    from megatron.core.models.gpt.gpt_model import GPTModel

    forward, calls = GPTModel.forward, {}

    def stalled_forward(self, *args, **kwargs):
        now = _now_iteration()
        calls[now] = calls.get(now, 0) + 1
        if now == iteration and calls[now] == fault.get("call", 1):
            _stall(fault)
        return forward(self, *args, **kwargs)

    patching.replace(GPTModel, "forward", stalled_forward, SCOPE)


# A small GPT that every drawn stall trains (pp and the schedule are drawn): 4 microbatches of 2 samples.
STALL_MODEL = (
    "--cpu --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 "
    "--seed 7 --train-iters 6"
).split()
SCHEDULES = ("zb-v", "zb-1p", "zb-2p", None)  # None: megatron-core's own 1F1B


def draw_stall(draw, mark: str, timeout_s: float | None = None) -> tuple[dict, list[str]]:
    """(FAULT, launcher flags) of a random stall: ``draw(choices)`` picks one (random.choice, or hypothesis').

    The rank, the pipeline size, the schedule (megatron-zb's or megatron-core's), the iteration, the point (a
    model forward, the grad-norm all-reduce, or the checkpoint save) and how the rank stalls are drawn.
    """
    pp = draw((2, 4))
    schedule = draw(SCHEDULES)
    at = draw(("forward", "forward", "grad-norm", "save"))
    fault = {
        "rank": draw(tuple(range(pp))),
        "at": at,
        "iteration": draw((2, 3)),
        "how": draw(HOW),
        "mark": mark,
        "seconds": 600,
    }
    if at == "forward":
        chunks = 2 if schedule == "zb-v" else 1
        fault["call"] = draw(tuple(range(1, 4 * chunks + 1)))  # 4 microbatches on each of the rank's chunks
    if timeout_s is not None:
        fault["timeout_s"] = timeout_s
    flags = [*STALL_MODEL, "--pipeline-model-parallel-size", str(pp), "--cpu-procs", str(pp)]
    if schedule is not None:
        flags += ["--pipeline-schedule", schedule]
    if at == "save":
        flags += ["--save", mark + ".checkpoints", "--save-interval", "1"]
    return fault, flags


def main(argv: Sequence[str] | None = None) -> int:
    fault_text, *flags = list(sys.argv[1:] if argv is None else argv)
    fault = json.loads(fault_text)
    if fault["at"] not in STALL_POINTS or fault.get("how", "sleep") not in HOW:
        raise SystemExit(f"stall {fault_text}: at is one of {', '.join(STALL_POINTS)}, how one of {', '.join(HOW)}")
    if "--megatron-lm" in flags:
        return _megatron_lm(fault, flags)
    from ..pretrain_gpt import _spawn_cpu
    from ..training.arguments import parse

    if "timeout_s" in fault:
        flags = [*flags, "--distributed-timeout-minutes", repr(fault["timeout_s"] / 60)]
    args = parse(flags)
    args.test_stall = fault
    return _spawn_cpu(args, worker=stalling_worker)


def _megatron_lm(fault: dict, flags: list[str]) -> int:
    """Megatron-LM's pretrain() on CPU with the fault on one rank (the launcher's checks, then a supervised spawn)."""
    from functools import partial

    from ..megatron_lm import launch as megatron_lm
    from ..megatron_lm import preflight

    launch, rest = megatron_lm.split_argv(flags)
    if "timeout_s" in fault:
        rest = [*rest, "--distributed-timeout-minutes", str(max(1, round(fault["timeout_s"] / 60)))]
    world = megatron_lm._world_size(launch, rest)
    checked = preflight.check(rest, world, megatron_lm.uses_own_providers())
    worker = partial(stalling_megatron_lm_worker, fault)
    original = megatron_lm._cpu_worker
    megatron_lm._cpu_worker = worker
    try:
        argv = [*rest, *preflight.setting_argv(checked.additions)]
        return megatron_lm.spawn_cpu(argv, world, launch.metrics_file, launch.cpu_threads, checked.timeout_s)
    finally:
        megatron_lm._cpu_worker = original


if __name__ == "__main__":
    sys.exit(main())
