"""Host memory in use by the process, sampled around every pass (CPU runs).

PyTorch keeps no allocator statistics on CPU; its tensors come from glibc's malloc, whose
``mallinfo2()`` reports the bytes in use (heap plus mmapped blocks). Sampling before and
after each pass gives the peak at pass boundaries, which is where activations pile up.
"""

from __future__ import annotations

import ctypes

from ..schedule import Pass, PassKind

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def bytes_in_use() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class MemorySampler:
    """Plugs into ``ForwardBackward(profiler=...)``: peak bytes above the baseline, per-F growth."""

    active = True

    def __init__(self) -> None:
        self.baseline = bytes_in_use()
        self.peak = 0
        self.growths: list[int] = []  # each F pass's growth: one microbatch's activations, plus noise

    def reset(self) -> None:
        self.baseline, self.peak = bytes_in_use(), 0

    def call(self, start: float, end: float, posted: float) -> None:
        """The executor reports each call's span (for the idle breakdown); memory has no use for it."""

    def run(self, p: Pass, chunk: int, fn, arg, waited=None) -> None:
        before = bytes_in_use()
        fn(arg)
        after = bytes_in_use()
        self.peak = max(self.peak, before - self.baseline, after - self.baseline)
        if p.kind is PassKind.F:
            self.growths.append(after - before)

    @property
    def forward_growth(self) -> int:
        """The median growth of an F pass: one microbatch's activations. Not the largest: malloc counts every
        thread's allocations, and the first forwards also allocate what stays (caches, gloo's buffers)."""
        ordered = sorted(self.growths)
        return ordered[len(ordered) // 2] if ordered else 0
