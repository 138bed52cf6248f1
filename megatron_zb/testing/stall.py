"""Test-only faults for the watchdog: one rank stops (sleeps) at a chosen point of training.

``python -m megatron_zb.testing.stall FAULT <megatron-zb train flags>`` runs the CPU launcher
with ``stalling_worker``, which installs the fault on its rank and then runs the normal worker.
FAULT is JSON: ``rank``, ``at`` (one of ``STALL_POINTS``), ``iteration``, for ``pass`` and
``send`` a ``match`` ("F s2 mb3", "activation of F s1 mb2"), ``seconds`` to sleep, ``mark`` (a
file that gets the wall time the stall began) and optionally ``timeout_s``, which sets
``--distributed-timeout-minutes`` in seconds. Nothing in the package calls this module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

STALL_POINTS = ("grad-norm", "save", "pass", "send")


def stalling_worker(rank: int, args: argparse.Namespace, port: int, path: list[str]) -> None:
    sys.path[:] = path
    from ..pretrain_gpt import _cpu_worker

    fault = args.test_stall
    if fault["rank"] == rank:
        _install(fault)
    _cpu_worker(rank, args, port, path)


def _stall(fault: dict) -> None:
    with open(fault["mark"], "w") as file:
        file.write(repr(time.time()))
    time.sleep(fault["seconds"])


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

        optimizer.get_grad_norm_fp32 = stalled_norm
    elif at == "save":  # before this rank writes its files (the others wait in the save's barrier)
        from ..training import checkpoint

        save = checkpoint.save_checkpoint

        def stalled_save(directory, at_iteration, *args, **kwargs):
            if at_iteration == iteration:
                _stall(fault)
            return save(directory, at_iteration, *args, **kwargs)

        checkpoint.save_checkpoint = stalled_save
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

        PipeComm.post = stalled_post
    else:
        raise ValueError(f"stall point {at!r}: use one of {', '.join(STALL_POINTS)}")


def main(argv: Sequence[str] | None = None) -> int:
    from ..pretrain_gpt import _spawn_cpu
    from ..training.arguments import parse

    fault_text, *flags = list(sys.argv[1:] if argv is None else argv)
    fault = json.loads(fault_text)
    if fault["at"] not in STALL_POINTS:
        raise SystemExit(f"stall point {fault['at']!r}: use one of {', '.join(STALL_POINTS)}")
    args = parse(flags)
    if "timeout_s" in fault:
        args.distributed_timeout_minutes = fault["timeout_s"] / 60
    args.test_stall = fault
    return _spawn_cpu(args, worker=stalling_worker)


if __name__ == "__main__":
    sys.exit(main())
