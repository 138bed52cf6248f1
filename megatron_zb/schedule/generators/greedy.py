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
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from itertools import product

from ..costs import CostModel
from ..ir import PassKind, ScheduleError
from ..placement import Placement
from ..timing import EPS, Clock
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
    run = _Greedy(placement, costs, microbatches, limit, switches)
    try:
        result = run.run()
        loose, tight = run.loose, run.tight
    except Stalled:
        strict = _Greedy(placement, costs, microbatches, limit, switches, strict=True)
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


class _Greedy:
    """The scheduler's state: what each rank knows when it decides (``decided``: the decision times,
    ``now``: each rank's clock) and the resulting order's as-soon-as-possible times (``asap``)."""

    def __init__(
        self,
        placement: Placement,
        costs: CostModel,
        m: int,
        limit: float | None,
        switches: Switches,
        strict: bool = False,
    ):
        model = model_of((placement,), m, costs)
        self.strict = strict
        self.m, self.sw, self.placement = m, switches, placement
        self.limit = float("inf") if limit is None else limit + EPS
        self.loose, self.tight = -math.inf, math.inf  # what the memory checks needed: passed, failed
        self.comm = costs.t_comm
        self.n = n = placement.num_stages
        self.rank = [placement.rank_of(s) for s in range(n)]
        self.f0, self.b0, self.w0 = (model.encoding.code(kind, 0, 0) for kind in (F, B, W))  # + s * m + k
        self.tf, self.tb, self.tw = (
            [model.duration(base + s * m) for s in range(n)] for base in (self.f0, self.b0, self.w0)
        )
        self.df = [model.delta(self.f0 + s * m) for s in range(n)]
        # per stage: the inputs of its F and B as (role row, T_comm if it crosses ranks else 0)
        self.f_in, self.b_in = (
            [
                tuple((row, self.comm if cross else 0.0) for row, cross in model.passes[base // m + s].inputs)
                for s in range(n)
            ]
            for base in (self.f0, self.b0)
        )
        p = placement.pp
        self.stages = [[s for s in range(n) if self.rank[s] == r] for r in range(p)]
        # memory a rank reserves when a microbatch enters it: its Fs on the rank's later chunks
        self.extra = [sum(self.df[s] for s in stages[1:]) for stages in self.stages]
        self.reserved = [0.0] * p  # strict: later-chunk F memory of the microbatches admitted
        self.decided, self.asap = Clock(model), Clock(model)
        self.f_next, self.b_next = [0] * n, [0] * n  # per stage: its next F and B
        self.known_f: list[float | None] = [None] * n  # their arrivals, once known
        self.known_b: list[float | None] = [None] * n
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.now = [0.0] * p
        self.remaining = [3 * m * len(stages) for stages in self.stages]
        self.sleeping = [False] * p
        self.heap: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
        self.steps_left = step_bound(placement, m)

    def _f_fits(self, r: int, s: int) -> bool:
        """Whether the F fits the limit; records the range of limits that decide alike (``loose``, ``tight``)."""
        first, level = s == self.stages[r][0], self.asap.level[r]
        if self.strict:
            if not first:
                return True
            need = level + self.reserved[r] + self.df[s] + self.extra[r]
        else:
            need = level + self.df[s] + (self.extra[r] if first else 0.0)
        if need <= self.limit:
            self.loose = max(self.loose, need)
            return True
        self.tight = min(self.tight, need)
        return False

    def run(self) -> Result:
        while True:
            while self.heap:
                t, r = heapq.heappop(self.heap)
                self._count_step()
                self._step(r, t)
            held = [r for r in range(len(self.now)) if self.remaining[r] and self.pending[r]]
            if not held:
                break
            for r in held:  # every rank waits while holding Ws: release memory
                self.sleeping[r] = False
                self._run_w(r, self.now[r])
        if any(self.remaining):
            stuck = [r for r, left in enumerate(self.remaining) if left]
            raise Stalled(f"the list scheduler stalled on ranks {stuck} (memory limit too tight for this layout)")
        return Result.of_clock(self.asap)

    def _count_step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise ScheduleError(
                f"the list scheduler did not finish within {step_bound(self.placement, self.m)} steps for "
                f"{self.n} stages x {self.m} microbatches: the costs must be finite numbers (NaN or infinite "
                "times never become ready)"
            )

    def _arrival(self, inputs: tuple[tuple[int, float], ...], k: int) -> float | None:
        """``Clock.ready`` of the decided clock for a pass of microbatch k with these inputs (inlined: the hot path)."""
        at, end = 0.0, self.decided.end
        for row, comm in inputs:
            arrival = end[row + k]
            if arrival < 0:
                return None
            arrival += comm
            if arrival > at:
                at = arrival
        return at

    def _step(self, r: int, t: float) -> None:
        sw, m, arrival = self.sw, self.m, self._arrival
        f_next, b_next, known_f, known_b = self.f_next, self.b_next, self.known_f, self.known_b
        ready_b: tuple[int, int] | None = None
        ready_f: int | None = None
        future_b: list[float] = []
        future: list[float] = []
        unknown: list[float] = []  # lower bounds of arrivals whose producer has not run yet
        memory_blocked = False
        soon = t + EPS
        for s in self.stages[r]:
            k = b_next[s]
            if k < f_next[s]:
                a = known_b[s]
                if a is None:
                    a = known_b[s] = arrival(self.b_in[s], k)  # once known, an arrival stays
                if a is None:
                    q = self.now[self.rank[s + 1]]
                    unknown.append((q if q > t else t) + self.tb[s + 1] + self.comm)
                elif a <= soon:
                    if ready_b is None or (k, -s) < (ready_b[1], -ready_b[0]):
                        ready_b = (s, k)
                else:
                    future_b.append(a)
            k = f_next[s]
            if k < m:
                a = known_f[s]
                if a is None:
                    a = known_f[s] = arrival(self.f_in[s], k)
                if a is None:
                    q = self.now[self.rank[s - 1]]
                    unknown.append((q if q > t else t) + self.tf[s - 1] + self.comm)
                elif not self._f_fits(r, s):
                    if a <= soon:
                        memory_blocked = True
                    else:
                        future.append(a)  # by then a W may have to make room
                elif a <= soon:
                    if ready_f is None or (s > ready_f) == sw.depth_first:
                        ready_f = s
                else:
                    future.append(a)
        future += future_b
        next_b = min(future_b, default=float("inf"))
        if ready_b is not None and (sw.prefer_b or ready_f is None):
            return self._run(r, t, self.b0 + ready_b[0] * m + ready_b[1])
        if ready_f is not None and not (sw.protect_b and ready_b is None and next_b < t + self.tf[ready_f] - EPS):
            return self._run(r, t, self.f0 + ready_f * m + f_next[ready_f])
        if self.pending[r]:
            s = self.pending[r][0][0]
            fits = not (sw.protect_b and next_b < t + self.tw[s] - EPS)
            if sw.fill_fit:
                gap = min((*future, *unknown), default=float("inf")) - t
                fits = fits and gap >= self.tw[s] - EPS
            if memory_blocked or fits:
                return self._run_w(r, t)
        if future:
            self._push(r, min(future))
        else:
            self.sleeping[r] = True

    def _push(self, r: int, t: float) -> None:
        self.now[r] = t
        heapq.heappush(self.heap, (t, r))

    def _wake(self, q: int) -> None:
        if self.sleeping[q]:
            self.sleeping[q] = False
            heapq.heappush(self.heap, (self.now[q], q))

    def _run(self, r: int, t: float, code: int) -> None:
        """Run an F or a B at decision time t (its inputs have arrived) and wake the rank it feeds."""
        s, k = divmod(code % (self.n * self.m), self.m)
        end = self.decided.mark(code, t)
        self.asap.place(code)
        if code < self.b0:
            self.f_next[s] += 1
            self.known_f[s] = None
            if self.strict:
                self.reserved[r] += self.extra[r] if s == self.stages[r][0] else -self.df[s]
            fed = s + 1 if s + 1 < self.n else None
        else:
            self.b_next[s] += 1
            self.known_b[s] = None
            self.pending[r].append((s, k))
            fed = s - 1 if s > 0 else None
        self._done(r, end)
        if fed is not None:
            self._wake(self.rank[fed])

    def _run_w(self, r: int, t: float) -> None:
        s, k = self.pending[r].popleft()
        self.asap.place(self.w0 + s * self.m + k)
        self._done(r, t + self.tw[s])

    def _done(self, r: int, end: float) -> None:
        self.remaining[r] -= 1
        if self.remaining[r]:
            self._push(r, end)
