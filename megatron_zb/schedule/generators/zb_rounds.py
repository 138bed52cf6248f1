"""Round-by-round zero-bubble heuristic on the linear placement (the ZB paper's section 3.1).

The timed list scheduler (greedy.py) decides pass by pass, which lets a rank run ahead: the
last rank runs F, B, F, B from its backlog of forwards and ranks further up starve later.
This heuristic keeps the pipeline in step instead. Round i runs microbatch i's B on every
stage, from the last stage up, and may give each stage one F before it. The warm-up gives
every stage as many Fs as end (or start, with ``overrun``) before microbatch 0's B comes back,
within the memory limit, and fewer than the stage before it. Whenever a stage would wait for
an input it runs pending Ws: all that end before the input arrives, then one more if the wait
is longer than the bubble it may still afford (the largest bubble of any stage so far) or if
``eager_w``. Each pass is placed on a ``timing.Clock`` as it is chosen, so the result's times
are the simulator's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import product

from ..costs import CostModel
from ..ir import PassKind, ScheduleError
from ..placement import linear
from ..timing import EPS, Clock
from .result import Result, model_of

KINDS = (PassKind.F, PassKind.B, PassKind.W)
F, B, W = range(3)  # positions in KINDS: the tables below are indexed by them


@dataclass(frozen=True)
class RoundSwitches:
    overrun: bool = False  # a warm-up F may start before microbatch 0's B arrives and end after it
    hold_f: bool = False  # a stage two Fs ahead of the next skips its F when that F would delay the B
    eager_w: bool = True  # any wait is filled with a W, even one the bubble budget could absorb


ROUND_SWITCHES = tuple(RoundSwitches(*flags) for flags in product((False, True), repeat=3))


class NoRoom(ScheduleError):
    """A pass needs more memory than the limit leaves and no W is pending to free it."""


def round_orders(costs: CostModel, microbatches: int, limit: float | None, switches: RoundSwitches) -> Result:
    """Per-rank orders of the round heuristic; raises NoRoom if the limit is too tight for it."""
    return _Rounds(costs, microbatches, limit, switches).run()


class _Rounds:
    def __init__(self, costs: CostModel, m: int, limit: float | None, switches: RoundSwitches):
        n = costs.pp
        self.n, self.m, self.sw = n, m, switches
        self.limit = float("inf") if limit is None else limit + EPS
        self.clock = Clock(model_of((linear(n),), m, costs))
        model = self.clock.model
        self.encoding, self.comm = model.encoding, model.comm
        self.base = [self.encoding.code(kind, 0, 0) for kind in KINDS]  # + stage * m + microbatch
        self.cost = [[model.duration(base + s * m) for s in range(n)] for base in self.base]
        self.delta = [[model.delta(base + s * m) for s in range(n)] for base in self.base]
        self.done = [[0] * n, [0] * n]  # Fs and Bs run, per stage
        self.pending: list[deque[int]] = [deque() for _ in range(n)]  # microbatches of the Ws to run, oldest first

    def run(self) -> Result:
        self._warm_up()
        for i in range(1, self.m):
            self._round(i)
        for s in range(self.n):
            while self.pending[s]:
                self._put(s, W)
        return Result.of_clock(self.clock)

    def _put(self, s: int, kind: int) -> None:
        pending = self.pending[s]
        code = self.base[kind] + s * self.m + (pending[0] if kind == W else self.done[kind][s])
        if not self.clock.place(code):
            raise ScheduleError(f"the rounds placed {self.encoding.decode(code)} before its input")
        if kind == W:
            pending.popleft()
            return
        self.done[kind][s] += 1
        if kind == B:
            pending.append(code % self.m)

    def _step(self, s: int, kind: int, cross_rank: bool) -> None:
        """Make room for the pass (pending Ws free memory), fill the wait for its input from another rank
        with pending Ws (see the module docstring), and place it."""
        clock, pending = self.clock, self.pending[s]
        while clock.level[s] + self.delta[kind][s] > self.limit:
            if not pending:
                raise NoRoom(f"stage {s} cannot fit its next {KINDS[kind]} under the memory limit")
            self._put(s, W)
        if cross_rank and pending:
            arrival = clock.ready(self.base[kind] + s * self.m + self.done[kind][s])
            free, cost_w = clock.free, self.cost[W][s]
            while pending and free[s] + cost_w <= arrival + EPS:
                self._put(s, W)
            if pending and free[s] < arrival - EPS:
                if self.sw.eager_w or arrival - free[s] > clock.most_idle - clock.idle[s]:
                    self._put(s, W)
        self._put(s, kind)

    def _warm_up(self) -> None:
        """Microbatch 0's F on every stage, the extra Fs that fit before its B returns, then its B."""
        n, m, clock = self.n, self.m, self.clock
        for s in range(n):
            self._step(s, F, s > 0)
        extra = [0] * n
        back = clock.free[n - 1] + self.cost[B][n - 1]  # when the last stage's B of microbatch 0 ends
        for s in range(n - 2, -1, -1):
            mem, t = clock.level[s], clock.free[s]
            while self.done[F][s] + extra[s] < m and mem + self.delta[F][s] <= self.limit:
                if (t >= back + self.comm) if self.sw.overrun else (t + self.cost[F][s] > back + self.comm + EPS):
                    break
                mem += self.delta[F][s]
                t += self.cost[F][s]
                extra[s] += 1
            back = max(t, back + self.comm) + self.cost[B][s]
        for s in range(1, n):  # each stage holds fewer forwards than the one before it
            if self.done[F][s] + extra[s] < m:
                extra[s] = max(0, min(extra[s], extra[s - 1] - 1))
        for s in range(n):
            for _ in range(extra[s]):
                self._step(s, F, s > 0)
        for s in range(n - 1, -1, -1):
            self._step(s, B, s < n - 1)

    def _round(self, i: int) -> None:
        n, m = self.n, self.m
        want = [self.done[F][s] < m for s in range(n)]
        if self.sw.hold_f:
            for s in range(n - 1):
                if want[s] and self.done[F][s] >= self.done[F][s + 1] + 2:
                    want[s] = self._f_pays_off(s)
        for s in range(n - 2, -1, -1):  # a stage runs an F only if the next one does
            want[s] = want[s] and want[s + 1]
        for s in range(n):
            if want[s]:
                self._step(s, F, s > 0)
        for s in range(n - 1, -1, -1):
            if s == 0 and self.done[F][0] == m:
                while self.pending[0]:  # cool-down on the first stage: the Bs come far apart
                    self._put(0, W)
            self._step(s, B, s < n - 1)

    def _f_pays_off(self, s: int) -> bool:
        """Whether a stage already ahead should run an F now rather than wait for its B."""
        clock = self.clock
        back = clock.free[s + 1] + self.cost[F][s + 1] + self.cost[B][s + 1] + self.comm
        if clock.free[s] >= back:
            return False
        room, extra, queue = clock.level[s] + self.delta[F][s], 0.0, len(self.pending[s])
        while room > self.limit and queue:
            room += self.delta[W][s]
            extra += self.cost[W][s]
            queue -= 1
        if clock.free[s] + self.cost[F][s] + extra <= back:
            return True
        return back - clock.free[s] > clock.most_idle - clock.idle[s]
