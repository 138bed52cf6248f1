"""Round-by-round zero-bubble heuristic on the V placement (the ZB paper's ZB-V, section 6).

Rank r holds the early block r and the late block 2pp-1-r. A microbatch runs F0 (early),
F1 (late), B1, B0 on it. The warm-up runs F0 of microbatch 0 down the ranks, then, from the
last rank up, as many F0s as end before the rank's F1 input arrives while keeping room for
2r+2 more chunk forwards; later ranks then catch up alternating chunks. After that, 2m rounds
each give every rank one B (B1 until B0's input is there) and at most one F (F1 when its input
is there, else F0). Before a pass whose input comes from another rank, pending Ws run when
they end before the input arrives, and one more when the wait exceeds the bubble the rank may
still afford (``fill_b``/``fill_f`` for B1 and F waits). A second run takes the first run's
per-rank bubbles as allowances, and the runs repeat while the largest bubble shrinks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import product

from ..costs import CostModel
from ..ir import ScheduleError
from ..placement import Placement, v_shape
from .greedy import EPS
from .result import B_CODE, F_CODE, W_CODE, Result
from .zb_rounds import NoRoom

F0, F1, B1, B0 = range(4)  # a microbatch's passes on a rank of the V, in dependency order
MAX_RERUNS = 8  # reruns with the previous run's bubbles as allowances; they stop once one does not help


@dataclass(frozen=True)
class VRoundSwitches:
    fill_b: bool = True  # a long wait for B1's input is filled with a W
    fill_f: bool = True  # a long wait for an F's input is filled with a W


V_ROUND_SWITCHES = tuple(VRoundSwitches(*flags) for flags in product((True, False), repeat=2))


class Unready(ScheduleError):
    """The round structure asked for a pass whose input no rank has produced yet."""


def v_round_orders(costs: CostModel, microbatches: int, limit: float | None, switches: VRoundSwitches) -> Result:
    """The best of repeated runs, each allowing the bubbles of the one before; raises NoRoom or Unready."""
    placement = v_shape(costs.pp)
    best = _VRounds(placement, costs, microbatches, limit, switches, None).run()
    for _ in range(MAX_RERUNS):
        try:
            again = _VRounds(placement, costs, microbatches, limit, switches, best.bubble).run()
        except (NoRoom, Unready):
            return best.result
        if max(again.bubble) >= max(best.bubble) - EPS:
            break
        best = again
    return best.result


@dataclass
class _Run:
    result: Result
    bubble: list[float]


class _VRounds:
    def __init__(
        self,
        placement: Placement,
        costs: CostModel,
        m: int,
        limit: float | None,
        switches: VRoundSwitches,
        allowed: list[float] | None,
    ):
        p, n = placement.pp, placement.num_stages
        self.p, self.m, self.sw = p, m, switches
        self.limit = float("inf") if limit is None else limit + EPS
        self.comm = costs.t_comm
        self.rank = [placement.rank_of(b) for b in range(n)]
        full = [placement.full_stage(b) for b in range(n)]
        self.tf = [costs.t_f[s] / 2 for s in full]
        self.tb = [costs.t_b[s] / 2 for s in full]
        self.tw = [costs.t_w[s] / 2 for s in full]
        self.df = [costs.mem_f[s] / 2 for s in full]
        self.db = [costs.mem_b[s] / 2 for s in full]
        self.dw = [costs.mem_w[s] / 2 for s in full]
        self.n = n
        # block of each pass type on rank r
        self.block = [(r, 2 * p - 1 - r, 2 * p - 1 - r, r) for r in range(p)]
        self.count = [[0] * 4 for _ in range(p)]
        self.f_end = [[-1.0] * m for _ in range(n)]
        self.b_end = [[-1.0] * m for _ in range(n)]
        self.free, self.first = [0.0] * p, [None] * p
        self.bubble, self.mem, self.peak = [0.0] * p, [0.0] * p, [0.0] * p
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.orders: list[list[int]] = [[] for _ in range(p)]  # encoded passes (result.py)
        self.max_bubble = 0.0
        self.source = self._sources()
        allowed = allowed or [0.0] * p
        self.allowance = [max(allowed) - a for a in allowed]

    def run(self) -> _Run:
        self._warm_up()
        for _ in range(2 * self.m):
            self._b_round()
            self._f_round()
        for r in range(self.p):
            while self.pending[r]:
                self._put_w(r)
        if any(sum(c) < 4 * self.m for c in self.count):
            raise Unready("the V rounds ended before every pass ran")
        spans = [self.free[r] - self.first[r] for r in range(self.p)]
        result = Result(self.orders, self.n, self.m, max(spans), max(self.free) - min(self.first), max(self.peak))
        return _Run(result, self.bubble)

    # -- inputs -------------------------------------------------------------------------------
    def _input(self, r: int, kind: int) -> tuple[float, bool]:
        """(time the input of rank r's next pass of this kind is ready or -1, whether it crosses ranks)."""
        ends, lag, cross = self.source[r][kind]
        if ends is None:
            return 0.0, False
        end = ends[self.count[r][kind]]
        return (-1.0, False) if end < 0 else (end + lag, cross)

    def _sources(self) -> list[list[tuple[list[float] | None, float, bool]]]:
        """Per rank and pass kind: the end times its input is read from, the latency, whether it crosses ranks."""
        table = []
        for r in range(self.p):
            row = []
            for kind in (F0, F1, B1, B0):
                b = self.block[r][kind]
                if kind in (F0, F1):
                    src, ends = b - 1, (self.f_end[b - 1] if b else None)
                elif b == self.n - 1:
                    src, ends = b, self.f_end[b]
                else:
                    src, ends = b + 1, self.b_end[b + 1]
                cross = ends is not None and self.rank[src] != r
                row.append((ends, self.comm if cross else 0.0, cross))
            table.append(row)
        return table

    # -- placing passes -----------------------------------------------------------------------
    def _start(self, r: int, ready: float, duration: float) -> float:
        start = max(self.free[r], ready)
        if self.first[r] is None:
            self.first[r] = start
        elif start > self.free[r]:
            self.bubble[r] += start - self.free[r]
            self.max_bubble = max(self.max_bubble, self.bubble[r])
        self.free[r] = start + duration
        return self.free[r]

    def _put(self, r: int, kind: int) -> None:
        b, k = self.block[r][kind], self.count[r][kind]
        if k >= self.m:
            raise Unready(f"rank {r} has no pass of kind {kind} left")
        ready, _ = self._input(r, kind)
        if ready < 0:
            raise Unready(f"rank {r}: the input of block {b} microbatch {k} is not there")
        is_f = kind in (F0, F1)
        self._room(r, self.df[b] if is_f else self.db[b])
        end = self._start(r, ready, self.tf[b] if is_f else self.tb[b])
        (self.f_end if is_f else self.b_end)[b][k] = end
        self.mem[r] += self.df[b] if is_f else self.db[b]
        self.peak[r] = max(self.peak[r], self.mem[r])
        self.count[r][kind] += 1
        self.orders[r].append(((F_CODE if is_f else B_CODE) * self.n + b) * self.m + k)
        if not is_f:
            self.pending[r].append((b, k))

    def _put_w(self, r: int) -> None:
        b, k = self.pending[r].popleft()
        self._start(r, self.b_end[b][k], self.tw[b])
        self.mem[r] += self.dw[b]
        self.orders[r].append((W_CODE * self.n + b) * self.m + k)

    def _room(self, r: int, delta: float) -> None:
        while self.mem[r] + delta > self.limit:
            if not self.pending[r]:
                raise NoRoom(f"rank {r} cannot fit its next pass under the memory limit")
            self._put_w(r)

    def _fill(self, r: int, kind: int, long_wait_w: bool) -> None:
        """Run pending Ws while the rank waits for an input from another rank."""
        ready, cross = self._input(r, kind)
        if not cross:
            return
        while self.pending[r] and ready >= self.free[r] + self.tw[self.pending[r][0][0]] - EPS:
            self._put_w(r)
        budget = max(self.max_bubble, self.allowance[r]) - self.bubble[r]
        if self.pending[r] and long_wait_w and ready - self.free[r] > budget + EPS:
            self._put_w(r)

    def _step(self, r: int, kind: int, long_wait_w: bool) -> None:
        self._room(r, self.df[self.block[r][kind]] if kind in (F0, F1) else 0.0)
        self._fill(r, kind, long_wait_w)
        self._put(r, kind)

    # -- phases -------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            self._put(r, F0)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                arrival, _ = self._input(r, F1)
                reserve = self.df[self.block[r][F0]] * (2 + 2 * r)
                while (
                    self.count[r][F0] < m
                    and self.mem[r] + reserve <= self.limit
                    and self.free[r] + self.tf[self.block[r][F0]] <= arrival + EPS
                ):
                    for q in range(r + 1):
                        self._put(q, F0)
            self._put(r, F1)
        chunk = F0
        for r in range(1, p):
            ahead, here = self.count[r - 1], self.count[r]
            while here[F0] + here[F1] < ahead[F0] + ahead[F1] or here[F1] <= ahead[F1] < m:
                for q in range(p - 1, r - 1, -1):
                    if self.count[q][chunk] < m:
                        self._put(q, chunk)
                chunk = F1 if chunk == F0 else F0

    def _b_round(self) -> None:
        p = self.p
        down, up = [], []  # B1 travels down the ranks, B0 up
        for r in range(p):
            c = self.count[r]
            if c[B0] >= c[B1]:
                down.append(r)
            elif r == p - 1 or c[B1] >= self.m or self._input(r, B0)[0] >= 0:
                up.append(r)
            else:
                down.append(r)
        for r in reversed(up):
            self._step(r, B0, True)
        for r in down:
            self._step(r, B1, self.sw.fill_b)

    def _f_round(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            c = self.count[r]
            if c[F1] >= m:
                continue
            if c[F1] >= c[F0]:
                kind = F0
            elif r == p - 1 or self._input(r, F1)[0] >= 0:
                kind = F1
            elif c[F0] < m and self._input(r, F0)[0] >= 0:
                kind = F0
            else:
                continue
            if self._input(r, kind)[0] < 0:
                continue
            self._step(r, kind, self.sw.fill_f)
