"""Runs one rank's passes of any schedule on its model chunks.

The executor knows passes, not schedules: the placement in the IR says which chunk runs a
stage and whether a neighbouring stage lives on this rank (handed over locally, as at the V
turn) or on another one (sent and received as ``comm.program`` derived). It dispatches on
the kind of pass: F, B (input gradients, weight gradients queued), W (the queued work), BW
(both at once), and the data-parallel actions of a lowered schedule, which go to the
data-parallel backend of the run (``runtime.dp``): UNSHARD (start gathering a chunk's weights;
every pass that runs on them waits for the gather first), RESHARD (release them), REDUCE_GRAD
(start the chunk's gradient reduction). The all-to-alls a lowered schedule splits out of passes
(A2A_F, A2A_B) run nothing here: megatron-core's dispatcher performs them, synchronously, inside
the pass that follows, and the profiler books their time to them (``expert_comm``).

An overlapped pair (``Schedule.overlapped``: an F beside a B or BW, adjacent in the order) is one
step: its receives are taken in this thread, the two passes run side by side (``overlap.Pairs``:
each one's collectives wait while the other computes), then the sends of both are posted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..schedule import Pass, PassKind, Schedule, ScheduleError
from ..schedule.actions import spec
from ..schedule.comm import CommOp, CommStep, Message, program
from . import steps
from .activity import activity
from .dp import DataParallelBackend
from .overlap import Pairs
from .p2p import PipeComm, Transfer
from .te_wgrad import BackwardDwJob
from .wgrad import WeightGradStore

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass
class RankPlan:
    """What this rank runs, precomputed once per schedule."""

    schedule: Schedule
    rank: int
    passes: tuple[Pass, ...]
    receives: tuple[tuple[Message, ...], ...]  # receives to have posted before each pass
    sends: tuple[tuple[Message, ...], ...]  # sends right after each pass
    fused: frozenset[tuple[int, int, int]]  # (pipe, stage, microbatch) whose backward is one BW pass
    paired: frozenset[int] = frozenset()  # indices i where passes i and i + 1 are an overlapped pair


@dataclass(frozen=True)
class PrefixCheck:
    """Where this rank checks the previous optimizer step (post-validation), and how to redo its prefix.

    ``passes`` is how many passes may run before the check (``schedule.speculation``);
    ``stale`` maps each sender to the messages it sends this rank within its own prefix;
    ``settle()`` checks the step and says whether the prefix ran on parameters that changed.
    """

    passes: int
    stale: dict[int, int]
    settle: Callable[[], bool]


def plan_rank(schedule: Schedule, rank: int, forward_only: bool = False) -> RankPlan:
    _check_forward_order(schedule, rank)
    if forward_only:
        orders = tuple(tuple(p for p in order if not spec(p.kind).backward) for order in schedule.orders)
        schedule = replace(schedule, orders=orders, overlapped=())  # no backward: no pair
    passes, receives, sends, waiting = [], [], [], []
    for step in program(schedule)[rank]:
        if isinstance(step, CommStep):
            if step.op is CommOp.RECV:
                waiting.append(step.message)
            else:
                sends[-1].append(step.message)
            continue
        passes.append(step)
        receives.append(tuple(waiting))
        sends.append([])
        waiting = []
    fused = frozenset((p.pipe, p.stage, p.microbatch) for p in passes if p.kind is PassKind.BW)
    paired = frozenset(i for i in range(len(passes) - 1) if schedule.partner(passes[i]) == passes[i + 1])
    return RankPlan(schedule, rank, tuple(passes), tuple(receives), tuple(map(tuple, sends)), fused, paired)


def _check_forward_order(schedule: Schedule, rank: int) -> None:
    """Each chunk reads its data iterator once per F, so its forwards must go in microbatch order."""
    last: dict[tuple[int, int], int] = {}
    for p in schedule.orders[rank]:
        if p.kind is PassKind.F:
            previous = last.get((p.pipe, p.stage), -1)
            if p.microbatch <= previous:
                raise ScheduleError(
                    f"{schedule.name}: rank {rank} runs {p} after F of mb{previous}; the runtime needs the "
                    f"forwards of each stage in microbatch order (data iterators are read in that order)"
                )
            last[p.pipe, p.stage] = p.microbatch


@dataclass(frozen=True)
class PairStep:
    """An overlapped pair as the watchdog names it (``activity.current_pass``)."""

    forward: Pass
    backward: Pass

    def __str__(self) -> str:
        return f"{self.forward} beside {self.backward}"


def _input_key(p: Pass, last: int) -> tuple | None:
    """Where ``p``'s received input waits: an F's activation (not stage 0), a B's gradient (not the last stage)."""
    if p.kind is PassKind.F:
        return None if p.stage == 0 else (ACTIVATION, p.pipe, p.stage, p.microbatch)
    return None if p.stage == last else (GRADIENT, p.pipe, p.stage, p.microbatch)


def inbox_key(message: Message) -> tuple:
    """Where a received tensor waits: the input of an F, or the output gradient of a B."""
    c = message.consumer
    kind = ACTIVATION if c.kind is PassKind.F else GRADIENT
    return (kind, c.pipe, c.stage, c.microbatch)


class Executor:
    """One iteration of one rank: ``run()`` walks the plan, then checks nothing is left over."""

    def __init__(
        self,
        plan: RankPlan,
        forward_ctx: steps.ForwardContext,
        comm: PipeComm,
        store: WeightGradStore,
        te_layers: list[list[torch.nn.Module]],
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        forward_only: bool = False,
        data_parallel: DataParallelBackend | None = None,
        profiler=None,
        receive_lookahead: int = 0,
        prefix_check: PrefixCheck | None = None,
        pairs: Pairs | None = None,
    ):
        if plan.paired and pairs is None:
            raise ScheduleError(
                f"{plan.schedule.name}: rank {plan.rank} runs overlapped pairs, but the executor was given no "
                "overlap.Pairs (twin process groups) to run them with"
            )
        if plan.paired and profiler is not None and not hasattr(profiler, "run_pair"):
            raise ScheduleError(
                f"{plan.schedule.name}: rank {plan.rank} runs overlapped pairs, which {type(profiler).__name__} "
                "cannot time (it has no run_pair); profile with a PassProfiler or plan without pairs"
            )
        if prefix_check is not None and prefix_check.passes - 1 in plan.paired:
            raise ScheduleError(
                f"{plan.schedule.name}: rank {plan.rank}'s post-validation prefix ends inside the overlapped pair "
                f"({plan.passes[prefix_check.passes - 1]}, {plan.passes[prefix_check.passes]}); a pair is one step"
            )
        self.pairs = pairs
        self.plan, self.ctx, self.comm, self.store = plan, forward_ctx, comm, store
        self.te_layers = te_layers
        self.shape, self.dtype, self.device = tensor_shape, dtype, device
        self.forward_only = forward_only
        self.data_parallel = data_parallel
        self.profiler = profiler
        self.lookahead = receive_lookahead
        self.config = forward_ctx.config
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.stash: dict[tuple, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.produced: dict[Pass, torch.Tensor] = {}
        self._all_receives = [m for group in plan.receives for m in group]
        self._posted = 0
        self.check = prefix_check
        # Before the check, post only what the prefix needs: all of it is sent inside the senders' prefixes.
        self._limit = (
            len(self._all_receives)
            if prefix_check is None
            else sum(len(group) for group in plan.receives[: prefix_check.passes])
        )
        self.redone = 0  # prefixes redone after a rolled-back optimizer step
        self._started_chunks: set[int] = set()
        self._dispatch = {
            PassKind.F: self._forward,
            PassKind.B: self._backward,
            PassKind.W: self._weight,
            PassKind.BW: self._backward_weight,
            PassKind.UNSHARD: self._unshard,
            PassKind.RESHARD: self._reshard,
            PassKind.REDUCE_GRAD: self._reduce_grad,
            PassKind.REPLICA_SYNC: self._replica_sync,
            PassKind.A2A_F: self._all_to_all,
            PassKind.A2A_B: self._all_to_all,
        }

    def run(self) -> None:
        plan = self.plan
        needed, index = 0, 0
        started = time.perf_counter()
        try:
            while index < len(plan.passes):
                if self.check is not None and index == self.check.passes:
                    check, self.check, self._limit = self.check, None, len(self._all_receives)
                    if check.settle():
                        self._redo_prefix(check)
                        needed, index = 0, 0
                        continue
                if index in plan.paired:
                    needed += len(plan.receives[index]) + len(plan.receives[index + 1])
                    self._run_pair(plan.passes[index], plan.passes[index + 1], needed)
                    self._post(needed, plan.sends[index] + plan.sends[index + 1])
                    index += 2
                    continue
                p = plan.passes[index]
                activity.pass_started(p)  # for the watchdog: where this rank is
                needed += len(plan.receives[index])
                self._post(needed, ())
                if self.data_parallel is not None and spec(p.kind).uses_weights:
                    self.data_parallel.wait_unsharded(plan.schedule.chunk_of(p), str(p))
                if self.profiler is not None:
                    self.profiler.run(p, plan.schedule.chunk_of(p), self._dispatch[p.kind], p, self._waited)
                else:
                    self._dispatch[p.kind](p)
                self._post(needed, plan.sends[index])
                index += 1
            if self.check is not None:  # a prefix that is the whole order: check at the end
                self.check, check = None, self.check
                if check.settle():
                    raise RuntimeError(
                        f"pipeline rank {plan.rank}: the previous optimizer step was redone after this rank's "
                        "last pass; its passes cannot be redone"
                    )
            self.comm.finish()
        except BaseException:
            self.comm.abort()
            raise
        if self.profiler is not None:
            self.profiler.call(started, time.perf_counter(), self.comm.posted_s)
        self._check_empty()

    def _waited(self) -> float:
        return self.comm.waited_s

    def _run_pair(self, first: Pass, second: Pass, needed: int) -> None:
        """One overlapped pair as one step: receives taken here, the two passes side by side (``overlap``)."""
        forward, backward = (first, second) if first.kind is PassKind.F else (second, first)
        activity.pass_started(PairStep(forward, backward))  # a stall inside the pair names both
        self._post(needed, ())
        schedule = self.plan.schedule
        for p in (forward, backward):
            if self.data_parallel is not None:
                self.data_parallel.wait_unsharded(schedule.chunk_of(p), str(p))
            key = _input_key(p, schedule.num_stages(p.pipe) - 1)
            if key is not None and key not in self.inbox:
                self.inbox[key] = self.comm.wait(key)  # P2P stays in this thread
        sides = (lambda: self._dispatch[forward.kind](forward), lambda: self._dispatch[backward.kind](backward))
        assert self.pairs is not None  # checked in __init__
        if self.profiler is None:
            self.pairs.run(*sides)
            return
        chunks = (schedule.chunk_of(forward), schedule.chunk_of(backward))
        self.profiler.run_pair((forward, backward), chunks, sides, self.pairs.run)

    # -- communication ------------------------------------------------------------------------
    def _redo_prefix(self, check: PrefixCheck) -> None:
        """Forget the prefix, drain what the other ranks sent inside theirs, and read the data again."""
        posted: dict[int, int] = {}
        for message in self._all_receives[: self._posted]:
            posted[message.src] = posted.get(message.src, 0) + 1
        stale = []
        for src, count in sorted(check.stale.items()):
            for seq in range(posted.get(src, 0), count):
                transfer = Transfer(src, f"message #{seq} of the redone prefix", False, seq)
                stale.append((transfer, torch.empty(self.shape, dtype=self.dtype, device=self.device)))
        self.comm.discard(stale)
        for table in (self.inbox, self.stash, self.produced):
            table.clear()
        self._posted = 0
        self._started_chunks.clear()
        self.ctx.restart()
        self.redone += 1

    def _post(self, needed: int, sends: tuple[Message, ...]) -> None:
        upto = min(needed + self.lookahead, self._limit)
        recvs = []
        for message in self._all_receives[self._posted : upto]:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            what = f"{message.payload} for {message.consumer}"
            recvs.append((inbox_key(message), Transfer(message.src, what, False, message.seq), buffer))
        self._posted = max(self._posted, upto)
        outgoing = []
        for message in sends:
            tensor = self.produced.pop(message.producer)
            transfer = Transfer(message.dst, f"{message.payload} of {message.producer}", True, message.seq)
            outgoing.append((transfer, tensor))
        self.comm.post(recvs, outgoing)

    def _take(self, key: tuple) -> torch.Tensor:
        if key in self.inbox:
            return self.inbox.pop(key)
        return self.comm.wait(key)

    def _is_local(self, pipe: int, stage: int) -> bool:
        placement = self.plan.schedule.placements[pipe]
        return 0 <= stage < placement.num_stages and placement.rank_of(stage) == self.plan.rank

    # -- passes -------------------------------------------------------------------------------
    def _forward(self, p: Pass) -> None:
        schedule = self.plan.schedule
        chunk, last = schedule.chunk_of(p), schedule.num_stages(p.pipe) - 1
        input_tensor = None
        if p.stage > 0:
            input_tensor = self._take((ACTIVATION, p.pipe, p.stage, p.microbatch))
            if not self.forward_only:
                input_tensor.requires_grad_()
        first = chunk not in self._started_chunks
        if first:
            self._started_chunks.add(chunk)
        # A microbatch whose backward is one BW pass runs megatron-core's own linears: W inline,
        # while the gradients are hot in cache, with no queue round trip.
        fused = (p.pipe, p.stage, p.microbatch) in self.plan.fused
        with self.store.paused() if fused else self.store.recording():
            output = steps.forward(self.ctx, chunk, p.microbatch, input_tensor, p.stage == last, first)
        if p.stage < last:
            self._hand_on(p, output)
        if not self.forward_only:
            self.stash[p.pipe, p.stage, p.microbatch] = (input_tensor, output)

    def _hand_on(self, p: Pass, output: torch.Tensor) -> None:
        if self._is_local(p.pipe, p.stage + 1):
            local = output.detach()
            self.inbox[ACTIVATION, p.pipe, p.stage + 1, p.microbatch] = (
                local if self.forward_only else local.requires_grad_()
            )
            return
        self.produced[p] = output.detach()  # an alias: freeing ``output`` below keeps what is sent
        if not self.forward_only and self.config.deallocate_pipeline_outputs:
            output.data = torch.empty((1,), device=output.device, dtype=output.dtype)

    def _backward(self, p: Pass) -> None:
        schedule = self.plan.schedule
        chunk, last = schedule.chunk_of(p), schedule.num_stages(p.pipe) - 1
        input_tensor, output = self.stash.pop((p.pipe, p.stage, p.microbatch))
        output_grad = None if p.stage == last else self._take((GRADIENT, p.pipe, p.stage, p.microbatch))
        fifo = [BackwardDwJob(self.te_layers[chunk])] if self.te_layers[chunk] else []
        with self.store.deferring((chunk, p.microbatch), fifo):
            input_grad = steps.backward(output, output_grad, input_tensor, self.config)
        del output, output_grad
        if p.stage == 0:
            return
        if self._is_local(p.pipe, p.stage - 1):
            self.inbox[GRADIENT, p.pipe, p.stage - 1, p.microbatch] = input_grad
        else:
            self.produced[p] = input_grad

    def _weight(self, p: Pass) -> None:
        self.store.run((self.plan.schedule.chunk_of(p), p.microbatch))

    def _backward_weight(self, p: Pass) -> None:
        self._backward(p)
        self._weight(p)

    # -- data-parallel actions ------------------------------------------------------------------
    def _unshard(self, p: Pass) -> None:
        if self.data_parallel is not None:
            self.data_parallel.unshard(self.plan.schedule.chunk_of(p))

    def _reshard(self, p: Pass) -> None:
        if self.data_parallel is not None:
            self.data_parallel.reshard(self.plan.schedule.chunk_of(p))

    def _reduce_grad(self, p: Pass) -> None:
        if self.data_parallel is not None:
            self.data_parallel.reduce_grad(self.plan.schedule.chunk_of(p))

    def _replica_sync(self, p: Pass) -> None:
        if self.data_parallel is None:
            raise ScheduleError(
                f"{p}: a schedule with two copies of a block needs a data-parallel backend to sync them"
            )
        self.data_parallel.replica_sync(self.plan.schedule.chunk_of(p))

    def _all_to_all(self, p: Pass) -> None:
        """Nothing to run: the dispatcher inside the next pass, ``p``'s pass, performs this all-to-all."""

    def _check_empty(self) -> None:
        left = [("inbox", self.inbox), ("activations", self.stash), ("unsent outputs", self.produced)]
        for name, table in left:
            if table:
                raise RuntimeError(f"pipeline rank {self.plan.rank}: {name} left after the iteration: {list(table)}")
        if not self.forward_only:
            self.store.check_empty()
