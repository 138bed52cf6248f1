"""The fork server every ``--cpu`` rank is forked from: it imports from the launcher's ``sys.path``.

Python's forkserver is handed the launcher's ``sys.path`` and ignores it (``forkserver.main`` takes
``sys_path`` and never sets it, 3.10-3.13), so a server started by a launcher that put a Megatron-LM
checkout first on its path imported the installed megatron-core instead, and every rank refused it.
``ensure`` starts the server with ``launcher_path`` preloaded first, which sets the path it is given
through the environment, and lets a running server go when the launcher's path or the modules to
preload changed since it started (a process that runs two checkouts, a test worker that runs
Megatron-LM and megatron-zb's own loop in turn).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from multiprocessing import forkserver

PATH_VARIABLE = "MEGATRON_ZB_FORK_SERVER_PATH"
PATH_MODULE = "megatron_zb.training.launcher_path"

_lock = threading.Lock()
_started: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # (sys.path, modules) of the running server


def ensure(modules: Sequence[str]) -> None:
    """A fork server that imported ``modules`` from this process's ``sys.path`` as it is now."""
    global _started
    server = forkserver._forkserver
    wanted = (tuple(sys.path), tuple(modules))
    with _lock:
        if _started != wanted:
            _let_go(server)
            server.set_forkserver_preload([PATH_MODULE, *modules])
        previous = os.environ.get(PATH_VARIABLE)
        os.environ[PATH_VARIABLE] = json.dumps(sys.path)
        try:
            server.ensure_running()  # starts one if none runs (or the last one died), with the path above
        finally:
            if previous is None:
                os.environ.pop(PATH_VARIABLE, None)
            else:
                os.environ[PATH_VARIABLE] = previous
        _started = wanted


def _let_go(server: forkserver.ForkServer) -> None:
    """Forget the running server without waiting for it: it ends once the ranks it forked have ended
    (they hold the other end of its "alive" pipe), and a thread reaps it then."""
    with server._lock:
        pid, alive, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
        if pid is None:
            return
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    os.close(alive)
    threading.Thread(target=_reap, args=(pid, address), name="megatron-zb fork server reaper", daemon=True).start()


def _reap(pid: int, address: str | None) -> None:
    os.waitpid(pid, 0)
    if address and not address.startswith("\0"):  # a path, not Linux's abstract socket namespace
        try:
            os.unlink(address)
        except OSError:
            pass
