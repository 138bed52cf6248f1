"""Two passes of one rank at once: one microbatch's forward beside another's backward (DualPipe's overlapped
F&B), so the collectives each runs inside it (MoE's expert-parallel all-to-all) wait while the other computes.

One compute stream, as on a GPU: the two run in two threads that take turns computing. A lock is held
while a side computes and let go while one of its collectives waits, so only communication overlaps
compute, and each side's math is that of its plain pass. The backward side's collectives go to process
groups of their own (``Twins``: the same ranks, made on every rank beforehand), because the collectives
of one group must come in one order on all its ranks, and the two sides interleave differently on each
rank. A collective of the backward side on a group without a twin raises, naming it, instead of hanging.
An asynchronous one (``async_op=True``: sequence parallelism's all-gather behind a linear's backward) is
issued at once and its handle's ``wait`` lets the other side compute, as a blocking call does.

Both sides must have their inputs (received activations, gradients) before the pair starts, and their
outputs are sent after it ends: a pair is one step of the rank's program (``Schedule.overlapped``;
the executor runs it). Each side keeps its own W-queue recording state and all-to-all meters
(``wgrad.own_thread``, ``expert_comm.own_thread``), starting from the caller's, so the two entering
and leaving them in either order undo nothing of the other's; the forward never defers work, and no
side recomputes (a recomputed forward inside the backward would run the MoE dispatcher's per-call
state beside the other side's forward): ``run_pair`` refuses nothing of that itself; the planner pairs
passes only where it holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from .. import patching
from . import expert_comm, wgrad
from .collective_wrapper import CollectiveWrapper

A = TypeVar("A")
B = TypeVar("B")


class Twins:
    """A second process group for each group a pair's backward uses: the same ranks, its own order."""

    def __init__(self, twins: dict[tuple[int, ...], dist.ProcessGroup]):
        self._twins = twins

    @classmethod
    def create(cls, groups: Iterable[dist.ProcessGroup | None]) -> Twins:
        """Collective over the default group: every rank names its groups (None: the default group); each
        distinct rank list of any rank gets a twin, made by every rank in one order, as ``new_group`` needs."""
        mine = sorted({tuple(dist.get_process_group_ranks(group or dist.group.WORLD)) for group in groups})
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        me, twins = dist.get_rank(), {}
        for ranks in sorted({ranks for lists in everyone for ranks in lists}):
            group = dist.new_group(list(ranks))
            if me in ranks:
                twins[ranks] = group
        return cls(twins)

    def of(self, group: dist.ProcessGroup | None, collective: str) -> dist.ProcessGroup:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        if ranks not in self._twins:
            raise RuntimeError(
                f"rank {dist.get_rank()}: {collective} on the group of ranks {list(ranks)} inside an overlapped "
                "forward and backward, but that group has no twin (Twins.create was not given it)"
            )
        return self._twins[ranks]


class _Side:
    def __init__(self, turn: threading.Lock, twins: Twins | None):
        self.turn, self.twins = turn, twins
        self.held = 0.0  # seconds this side held the turn: its compute
        self._since = 0.0

    def take(self) -> None:
        self.turn.acquire()
        self._since = time.perf_counter()

    def give(self) -> None:
        self.held += time.perf_counter() - self._since
        self.turn.release()


_side = threading.local()  # .value: the _Side of the pair this thread runs, if any


class PairCollectives(CollectiveWrapper):
    """While active, a collective called by a side of a pair lets the other side compute while it waits (and,
    on the backward side, runs on the group's twin); every other call goes straight through."""

    marker = "_pair_collectives"

    def _call(self, op: str, original, bound: Callable[[], dict], args: tuple, kwargs: dict):
        side: _Side | None = getattr(_side, "value", None)
        if side is None:
            return original(*args, **kwargs)
        arguments = bound()
        if side.twins is not None:
            kwargs = {**arguments, "group": side.twins.of(arguments.get("group"), op)}
            args = ()
        if arguments.get("async_op"):  # e.g. sequence parallelism's all-gather behind a linear's backward
            return _Waiting(original(*args, **kwargs), side)  # issued now; the side computes on until its wait
        side.give()  # the other side computes while this one waits
        try:
            return original(*args, **kwargs)
        finally:
            side.take()


class _Waiting:
    """An asynchronous collective's handle, issued by a side of a pair: its ``wait`` lets the other side compute."""

    def __init__(self, work: Any, side: _Side):
        self._work, self._side = work, side

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_side, "value", None) is not self._side:  # waited after the pair ended: nothing to hand over
            return self._work.wait(*args, **kwargs)
        self._side.give()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._side.take()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextmanager
def _as_side(side: _Side) -> Iterator[None]:
    _side.value = side
    side.take()
    try:
        yield
    finally:
        side.give()
        _side.value = None


def run_pair(
    forward: Callable[[], A],
    backward: Callable[[], B],
    twins: Twins,
    wrapper: PairCollectives,
    held: list[float] | None = None,
) -> tuple[A, B]:
    """``forward()`` in this thread beside ``backward()`` in another, taking turns to compute (see the module);
    ``held`` gets each side's seconds holding the turn (its compute, host time)."""
    if not wrapper.active:
        raise RuntimeError("start the PairCollectives first: the collectives must let the other side compute")
    turn = threading.Lock()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]
    sides = (_Side(turn, None), _Side(turn, twins))

    def run(index: int, work: Callable, side: _Side) -> None:
        try:
            with wgrad.own_thread(), expert_comm.own_thread(backward=index == 1), _as_side(side):
                results[index] = work()
        except BaseException as error:  # re-raised in the caller's thread
            errors[index] = error

    other = threading.Thread(target=run, args=(1, backward, sides[1]), name="overlapped-backward")
    other.start()
    run(0, forward, sides[0])
    other.join()
    if held is not None:
        held[:] = [side.held for side in sides]
    for error in errors:
        if error is not None:
            raise error
    return results[0], results[1]


class _SideBuffers:
    """megatron-core's global memory buffer as a pair's backward side sees it: a buffer of its own.

    Sequence parallelism all-gathers into the buffer's one "mpu" tensor; the backward's all-gather is
    asynchronous, so the forward side's gather into the same tensor would overwrite it while pending.
    """

    def __init__(self, shared: Any):
        self.shared, self.own = shared, type(shared)()

    def get_tensor(self, *args: Any, **kwargs: Any) -> Any:
        side: _Side | None = getattr(_side, "value", None)
        buffer = self.own if side is not None and side.twins is not None else self.shared
        return buffer.get_tensor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shared, name)


@contextmanager
def _side_buffers(buffers: dict) -> Iterator[None]:
    """megatron-core's global memory buffer split by side while pairs run (``buffers`` keeps the backward's
    between calls); nothing where megatron-core or its buffer is absent."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        parallel_state = None
    shared = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if shared is None:
        yield
        return
    if buffers.get("shared") is not shared:
        buffers.update(shared=shared, split=_SideBuffers(shared))
    patch = patching.replace(parallel_state, "_GLOBAL_MEMORY_BUFFER", buffers["split"])
    try:
        yield
    finally:
        patching.revert(patch)


class Pairs:
    """The overlapped pairs of one rank's pass walk: the twin groups (made once, ``Twins.create``) and, while
    ``running``, the collectives wrapped and megatron-core's global memory buffer split by side."""

    def __init__(self, twins: Twins):
        self.twins = twins
        self.wrapper = PairCollectives()
        self._buffers: dict = {}

    @contextmanager
    def running(self) -> Iterator[Pairs]:
        self.wrapper.start()
        try:
            with _side_buffers(self._buffers):
                yield self
        finally:
            self.wrapper.stop()

    def run(self, forward: Callable[[], object], backward: Callable[[], object]) -> tuple[float, float]:
        """Run one pair (``run_pair``); each side's seconds of compute."""
        held: list[float] = []
        run_pair(forward, backward, self.twins, self.wrapper, held)
        return held[0], held[1]


def model_parallel_groups() -> list[dist.ProcessGroup | None]:
    """The groups a backward's collectives may use, from megatron-core's ``parallel_state``: the default group,
    tensor (and context), expert and expert-tensor parallel; those not initialised are left out."""
    from megatron.core import parallel_state

    getters = (
        "get_tensor_model_parallel_group",
        "get_context_parallel_group",
        "get_tensor_and_context_parallel_group",
        "get_expert_model_parallel_group",
        "get_expert_tensor_parallel_group",
        "get_expert_tensor_and_model_parallel_group",
    )
    groups: list[dist.ProcessGroup | None] = [None]
    for name in getters:
        getter = getattr(parallel_state, name, None)
        try:
            group = getter() if getter is not None else None
        except (AssertionError, RuntimeError):  # not initialised in this run
            group = None
        if isinstance(group, dist.ProcessGroup):
            groups.append(group)
    return groups
