"""Timed list scheduling under a memory limit: the engine behind zb-auto and v-auto.

All ranks are simulated together with the cost model. Whenever a rank is free it picks its
next pass from what has arrived: a B if one is ready (1F-1B steady state), else an F if the
memory limit allows it, else a pending W to fill the gap or to release memory. Because
each decision knows when inputs arrive, warm-up forwards stop where the first B comes
back, Ws land in the gaps that would otherwise idle, and non-uniform costs or a comm
latency shift the whole pattern instead of breaking it. ``Switches`` are the heuristic's
choices; callers try all of them and keep the best schedule by simulated stage span.

Memory is admitted per microbatch: a rank's first F of a microbatch needs room left for one
F on each of the rank's later chunks (the V turn). Without it a rank could fill up with
early chunks while the F that lets the oldest microbatch turn has no room: a deadlock.
On the V (the turn is local) that check suffices. On a looping placement with several chunks
the room checked at admission can be taken by later admissions before the microbatch comes
back; if the scheduler stalls there it runs again with the room held (``strict``): each
admitted microbatch keeps its later chunks' F memory reserved until those Fs run, so the
oldest microbatch can always advance and the scheduler never stalls.

Every step either places a pass or moves a rank's clock to a known arrival, so the number of
steps is linear in the number of passes (``step_bound``); a cost model that breaks this (NaN
times are never "ready") ends with a ScheduleError instead of looping forever.

A search that only needs runs with a stage span at most some value (``pruned_above``) has a run
stopped (``Pruned``) once a rank's span so far plus the work it has left is over it: that run
could not be kept, and the runs that finish are the ones they would have been.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import product

from ..costs import CostModel
from ..ir import PassKind, ScheduleError
from ..placement import Placement
from ..timing import EPS
from .result import Result, model_of

F, B, W = PassKind.F, PassKind.B, PassKind.W


@dataclass(frozen=True)
class Switches:
    prefer_b: bool = True  # a ready B goes before a ready F (otherwise F first: longer warm-up)
    protect_b: bool = False  # do not start an F or W that would still run when a B arrives
    fill_fit: bool = True  # fill a gap with a W only if the gap is known to be at least T_W
    depth_first: bool = True  # several chunks: the deepest ready F first (finish microbatches early)


# the settings that won most often on a grid of sizes, costs and limits come first
_ORDER = product((True, False), (True, False), (False, True), (True, False))
ALL_SWITCHES = tuple(
    Switches(prefer_b, protect, fill_fit, depth_first) for depth_first, fill_fit, protect, prefer_b in _ORDER
)


def step_bound(placement: Placement, microbatches: int) -> int:
    """More steps than the list scheduler takes for finite costs: passes x (waits per pass), with room to spare.

    A rank waits at most once per arrival it can see (two per chunk) between two of its passes, and once
    per pass another rank finishes; every pass wakes at most one rank.
    """
    passes = 3 * microbatches * placement.num_stages
    return 4 * (2 * placement.chunks + 3) * (passes + placement.pp) + 1000


def min_memory_limit(placement: Placement, costs: CostModel) -> float:
    """The least limit any schedule needs: one microbatch's activations of a rank's chunks."""
    per_rank = [0.0] * placement.pp
    for stage, (rank, _) in enumerate(placement.blocks):
        per_rank[rank] += costs.mem_f[placement.full_stage(stage)] / placement.chunks
    return max(per_rank)


def check_memory_costs(name: str, costs: CostModel) -> None:
    if any(v > 0 for v in (*costs.mem_b, *costs.mem_w)):
        raise ScheduleError(f"{name} assumes B and W release memory: --mem-b and --mem-w must be <= 0")


def greedy_orders(
    placement: Placement,
    costs: CostModel,
    microbatches: int,
    limit: float | None,
    switches: Switches = Switches(),
) -> Result:
    """Per-rank orders from the timed list scheduler; ``limit`` None means unlimited.

    The limit only enters through the memory checks, so a run is the run of every limit that passes
    the same checks and fails the same ones: it is kept with that range (``_RUNS``) and served again
    to a search that asks for another limit in it (v-auto's ladder, zb-v inside v-auto, the unlimited run).
    """
    cap = math.inf if limit is None else limit + EPS
    key = (placement, costs, microbatches, switches)
    runs = _RUNS.pop(key, [])
    _RUNS[key] = runs  # most recently used last
    for loose, tight, result in runs:
        if loose <= cap and (cap < tight or tight == math.inf):
            return result
    bound = _SPAN_BOUND.get()
    run = _Greedy(placement, costs, microbatches, limit, switches, bound=bound)
    try:
        result = run.run()
        loose, tight = run.loose, run.tight
    except Stalled:
        strict = _Greedy(placement, costs, microbatches, limit, switches, strict=True, bound=bound)
        result = strict.run()
        loose, tight = max(run.loose, strict.loose), min(run.tight, strict.tight)
    runs.append((loose, tight, result))
    while sum(map(len, _RUNS.values())) > RUNS_KEPT:
        _RUNS.pop(next(iter(_RUNS)))
    return result


RUNS_KEPT = 24  # runs kept for reuse (a run at pp=64, m=512 holds a few MB)
# per (placement, costs, microbatches, switches): (loose, tight, result): the result of every memory cap
# c with loose <= c < tight (the most a passed check needed, the least a failed one needed)
_RUNS: dict[tuple, list[tuple[float, float, Result]]] = {}


class Stalled(ScheduleError):
    """The list scheduler could not place any pass: the memory admitted could not drain."""


class Pruned(ScheduleError):
    """The run was stopped: its stage span would be over the bound ``pruned_above`` set."""


_SPAN_BOUND: ContextVar[float | None] = ContextVar("span_bound", default=None)


@contextmanager
def pruned_above(span: float | None) -> Iterator[None]:
    """Within the block, a run raises ``Pruned`` as soon as its stage span must end over ``span`` (None: never)."""
    token = _SPAN_BOUND.set(span)
    try:
        yield
    finally:
        _SPAN_BOUND.reset(token)


def _own_role(writes: tuple[int, ...]) -> int:
    """The one role row an F, B or W fulfils (the list scheduler places split passes only)."""
    if len(writes) != 1:
        raise ScheduleError(f"the list scheduler places passes of one role each, got one fulfilling {len(writes)}")
    return writes[0]


class _Greedy:
    """The scheduler's state: what each rank knows when it decides (``dend``: the roles' ends at the
    decision times, ``now``: each rank's clock) and the resulting order's as-soon-as-possible times
    (``aend``, per rank ``afree``, ``afirst``, memory ``level`` and ``peak``: ``Clock.place`` inlined).

    Everything the loop reads is a flat list indexed by stage, rank or role row, built once here:
    the planners run it thousands of passes deep for every switch setting, so ``run`` is one loop
    over local names (``_step`` of earlier versions, with its calls inlined; the decisions are the same).
    """

    def __init__(
        self,
        placement: Placement,
        costs: CostModel,
        m: int,
        limit: float | None,
        switches: Switches,
        strict: bool = False,
        bound: float | None = None,
    ):
        model = model_of((placement,), m, costs)
        self.model, self.strict = model, strict
        # a stage span over this cannot be kept (``pruned_above``); the margin covers rounding in ``left``
        self.bound = math.inf if bound is None else bound + 1e-9 * max(1.0, abs(bound))
        self.m, self.sw, self.placement = m, switches, placement
        self.limit = float("inf") if limit is None else limit + EPS
        self.loose, self.tight = -math.inf, math.inf  # what the memory checks needed: passed, failed
        self.comm = comm = costs.t_comm
        self.n = n = placement.num_stages
        self.rank = [placement.rank_of(s) for s in range(n)]
        self.f0, self.b0, self.w0 = (model.encoding.code(kind, 0, 0) for kind in (F, B, W))  # + s * m + k
        # per kind (F, B, W), per stage: (inputs as (role row, T_comm if it crosses ranks else 0), the row
        # of its own role, duration, memory delta), read from the model's facts for (kind, block)
        self.facts = [
            [
                (
                    tuple((row, comm if cross else 0.0) for row, cross in facts.inputs),
                    _own_role(facts.writes),
                    facts.time,
                    facts.memory,
                )
                for facts in model.passes[base // m : base // m + n]
            ]
            for base in (self.f0, self.b0, self.w0)
        ]
        self.tf, self.tb, self.tw = ([time for _, _, time, _ in per] for per in self.facts)
        self.df = [memory for _, _, _, memory in self.facts[0]]
        p = placement.pp
        self.stages = [[s for s in range(n) if self.rank[s] == r] for r in range(p)]
        # memory a rank reserves when a microbatch enters it: its Fs on the rank's later chunks
        self.extra = [sum(self.df[s] for s in stages[1:]) for stages in self.stages]
        self.steps_left = step_bound(placement, m)

    def run(self) -> Result:
        """Place every pass; raises ``Stalled`` when memory admitted cannot drain."""
        sw, m, n, comm, limit, strict = self.sw, self.m, self.n, self.comm, self.limit, self.strict
        rank, stages, extra, df = self.rank, self.stages, self.extra, self.df
        tf, tb, tw = self.tf, self.tb, self.tw
        f_facts, b_facts, w_facts = self.facts
        f0, b0, w0 = self.f0, self.b0, self.w0
        prefer_b, protect_b, fill_fit, depth_first = sw.prefer_b, sw.protect_b, sw.fill_fit, sw.depth_first
        p = len(stages)
        first_stage = [chunks[0] for chunks in stages]
        # per rank, per stage it holds: (stage, inputs of its B, of its F, whether it is the rank's first, F memory)
        lanes = [[(s, b_facts[s][0], f_facts[s][0], s == chunks[0], df[s]) for s in chunks] for chunks in stages]
        inf = math.inf
        heappush, heappop = heapq.heappush, heapq.heappop
        loose, tight, steps_left = self.loose, self.tight, self.steps_left
        bound = self.bound
        work = [m * sum(tf[s] + tb[s] + tw[s] for s in chunks) for chunks in stages]  # per rank, not yet placed
        # the decisions: roles' ends at decision time; per stage its next F and B and their arrivals once known
        dend = [-1.0] * self.model.roles
        f_next, b_next = [0] * n, [0] * n
        # their arrivals once known (None: not asked yet; -1 - i below 0: waiting for role i to end)
        known_f: list[float | None] = [None] * n
        known_b: list[float | None] = [None] * n
        reserved = [0.0] * p  # strict: later-chunk F memory of the microbatches admitted
        pending: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        now, sleeping = [0.0] * p, [False] * p
        remaining = [3 * m * len(chunks) for chunks in stages]
        heap: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
        # the order's as-soon-as-possible times (what the result reports)
        aend = [-1.0] * self.model.roles
        afree, afirst, level, peak = [0.0] * p, [-1.0] * p, [0.0] * p, [0.0] * p
        orders: list[list[int]] = [[] for _ in range(p)]

        while True:
            while heap:
                t, r = heappop(heap)
                steps_left -= 1
                if steps_left < 0:
                    self.steps_left = steps_left
                    self._count_step()
                ready_b = ready_bk = ready_f = -1
                next_b = next_f = inf  # the earliest arrival of a B, of an F, after t
                memory_blocked = unknown = False  # unknown: an arrival whose producer has not run yet
                soon = t + EPS
                level_r = level[r]
                for s, b_in, f_in, head, grows in lanes[r]:
                    k, kf = b_next[s], f_next[s]
                    if k < kf:
                        a = known_b[s]
                        if a is None or (a < 0 and dend[-1 - a] >= 0):
                            a = 0.0
                            for row, c in b_in:
                                e = dend[row + k]
                                if e < 0:
                                    a = -1 - row - k  # waiting for this role
                                    break
                                e += c
                                if e > a:
                                    a = e
                            known_b[s] = a  # once known, an arrival stays
                        if a < 0:
                            unknown = True
                        elif a <= soon:
                            if ready_b < 0 or k <= ready_bk:  # the oldest microbatch, then the deepest stage
                                ready_b, ready_bk = s, k
                        elif a < next_b:
                            next_b = a
                    if kf < m:
                        k = kf
                        a = known_f[s]
                        if a is None or (a < 0 and dend[-1 - a] >= 0):
                            a = 0.0
                            for row, c in f_in:
                                e = dend[row + k]
                                if e < 0:
                                    a = -1 - row - k  # waiting for this role
                                    break
                                e += c
                                if e > a:
                                    a = e
                            known_f[s] = a
                        if a < 0:
                            unknown = True
                            continue
                        # whether the F fits the limit, recording the range of limits that decide alike
                        if head:
                            if strict:
                                need = level_r + reserved[r] + grows + extra[r]
                            else:
                                need = level_r + grows + extra[r]
                        elif strict:
                            need = -inf  # a later chunk's F: its memory was reserved on admission
                        else:
                            need = level_r + grows + 0.0
                        if need <= limit:
                            if need > loose:
                                loose = need
                            if a <= soon:
                                if ready_f < 0 or depth_first:
                                    ready_f = s
                            elif a < next_f:
                                next_f = a
                        else:
                            if need < tight:
                                tight = need
                            if a <= soon:
                                memory_blocked = True
                            elif a < next_f:
                                next_f = a  # by then a W may have to make room
                future = next_f if next_f < next_b else next_b
                if ready_b >= 0 and (prefer_b or ready_f < 0):
                    s, k, kind, code = ready_b, ready_bk, b_facts, b0 + ready_b * m + ready_bk
                elif ready_f >= 0 and not (protect_b and ready_b < 0 and next_b < t + tf[ready_f] - EPS):
                    s = ready_f
                    k, kind = f_next[s], f_facts
                    code = f0 + s * m + k
                else:
                    kind = None
                    if pending[r]:
                        s = pending[r][0][0]
                        fits = not (protect_b and next_b < t + tw[s] - EPS)
                        if fill_fit and fits and not memory_blocked:
                            gap = future
                            if unknown:  # lower bounds of the arrivals not known yet
                                for s in stages[r]:
                                    if b_next[s] < f_next[s] and known_b[s] < 0:
                                        q = now[rank[s + 1]]
                                        a = (q if q > t else t) + tb[s + 1] + comm
                                        if a < gap:
                                            gap = a
                                    if f_next[s] < m and known_f[s] < 0:
                                        q = now[rank[s - 1]]
                                        a = (q if q > t else t) + tf[s - 1] + comm
                                        if a < gap:
                                            gap = a
                                s = pending[r][0][0]
                            fits = gap - t >= tw[s] - EPS
                        if memory_blocked or fits:
                            s, k = pending[r].popleft()
                            kind, code = w_facts, w0 + s * m + k
                    if kind is None:
                        if future < inf:
                            now[r] = future
                            heappush(heap, (future, r))
                        else:
                            sleeping[r] = True
                        continue
                inputs, role, time, memory = kind[s]
                end = t + time
                if kind is not w_facts:  # an F or B: its end at the decision time, seen by the passes it feeds
                    dend[role + k] = end
                # Clock.place: as soon as the rank and the inputs allow
                ready = afree[r]
                for row, c in inputs:
                    e = aend[row + k] + c
                    if e > ready:
                        ready = e
                if afirst[r] < 0:
                    afirst[r] = ready
                aend[role + k] = afree[r] = ready + time
                work[r] -= time
                if afree[r] + work[r] - afirst[r] > bound:
                    raise Pruned(f"rank {r}'s stage span would be over {bound:g}")
                used = level[r] = level[r] + memory
                if used > peak[r]:
                    peak[r] = used
                orders[r].append(code)
                fed = -1
                if kind is f_facts:
                    f_next[s] += 1
                    known_f[s] = None
                    if strict:
                        reserved[r] += extra[r] if s == first_stage[r] else -df[s]
                    if s + 1 < n:
                        fed = rank[s + 1]
                elif kind is b_facts:
                    b_next[s] += 1
                    known_b[s] = None
                    pending[r].append((s, k))
                    if s > 0:
                        fed = rank[s - 1]
                left = remaining[r] = remaining[r] - 1
                if left:
                    now[r] = end
                    heappush(heap, (end, r))
                if fed >= 0 and sleeping[fed]:  # wake the rank it feeds
                    sleeping[fed] = False
                    heappush(heap, (now[fed], fed))
            held = [r for r in range(p) if remaining[r] and pending[r]]
            if not held:
                break
            for r in held:  # every rank waits while holding Ws: release memory
                sleeping[r] = False
                s, k = pending[r].popleft()
                inputs, role, time, memory = w_facts[s]
                ready = afree[r]
                for row, c in inputs:
                    e = aend[row + k] + c
                    if e > ready:
                        ready = e
                if afirst[r] < 0:
                    afirst[r] = ready
                aend[role + k] = afree[r] = ready + time
                work[r] -= time
                if afree[r] + work[r] - afirst[r] > bound:
                    raise Pruned(f"rank {r}'s stage span would be over {bound:g}")
                used = level[r] = level[r] + memory
                if used > peak[r]:
                    peak[r] = used
                orders[r].append(w0 + s * m + k)
                left = remaining[r] = remaining[r] - 1
                if left:
                    now[r] = now[r] + time
                    heappush(heap, (now[r], r))
        self.loose, self.tight, self.steps_left = loose, tight, steps_left
        if any(remaining):
            stuck = [r for r, left in enumerate(remaining) if left]
            raise Stalled(f"the list scheduler stalled on ranks {stuck} (memory limit too tight for this layout)")
        busy = [r for r, order in enumerate(orders) if order]
        span = max((afree[r] - afirst[r] for r in busy), default=0.0)
        makespan = max(afree) - min((afirst[r] for r in busy), default=0.0)
        return Result(orders, self.model.encoding, span, makespan, max(peak, default=0.0))

    def _count_step(self) -> None:
        if self.steps_left < 0:
            raise ScheduleError(
                f"the list scheduler did not finish within {step_bound(self.placement, self.m)} steps for "
                f"{self.n} stages x {self.m} microbatches: the costs must be finite numbers (NaN or infinite "
                "times never become ready)"
            )
