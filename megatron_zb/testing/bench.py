"""What the CPU benchmarks in scripts/ share: gloo ranks with one thread each, and the report file."""

from __future__ import annotations

import os
from collections.abc import Callable


def run_on_cpu_ranks(world_size: int, fn: Callable, **kwargs) -> list:
    """``fn(**kwargs)`` on ``world_size`` gloo processes, one compute thread each; results in rank order.

    glibc hands large blocks back to the kernel on free and faults fresh pages in on the next
    allocation, a cost that grows with the memory a schedule holds and that GPU caching
    allocators do not have; the workers keep freed memory instead, for every run alike.
    """
    from .pool import WorkerPool

    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):  # read by the spawned workers' glibc
        os.environ.setdefault(name, str(4 << 30))
    pool = WorkerPool(world_size, threads=1, timeout_s=3600)
    try:
        return pool.run(fn, **kwargs)
    finally:
        pool.close()


def report(text: str, title: str, script: str, output: str | None) -> None:
    """Print the table; with ``output``, also write it as a page that says how it was measured."""
    print(text)
    if output:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(f"# {title}\n\nMeasured with `python scripts/{script} --output {output}`.\n\n{text}")
