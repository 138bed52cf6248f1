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

The runs decide with the costs they are given. With unequal stages, runs given every stage's
median cost (``flat``, as the reference planner plans) and timed on the true ones had the
shorter stage span on 18 of scripts/bench_vs_reference.py's 120 settings, up to 0.7 points:
zb-v takes both as candidates.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace
from itertools import product

from ..costs import CostModel
from ..ir import ScheduleError
from ..placement import v_shape
from ..timing import EPS, Clock
from .budget import BUDGET
from .result import Result, model_of
from .v_blocks import B0, B1, F0, F1, item_bases
from .zb_rounds import NoRoom


@dataclass(frozen=True)
class VRoundSwitches:
    fill_b: bool = True  # a long wait for B1's input is filled with a W
    fill_f: bool = True  # a long wait for an F's input is filled with a W


V_ROUND_SWITCHES = tuple(VRoundSwitches(*flags) for flags in product((True, False), repeat=2))


def flat(costs: CostModel) -> CostModel:
    """The costs with each time the median over the stages (memory and the ends' extras kept; no all-to-all,
    which planners of compute passes do not read and which may exceed a median it was a part of)."""
    times = {name: [statistics.median(getattr(costs, name))] * costs.pp for name in ("t_f", "t_b", "t_w")}
    return replace(costs, **times, t_a2a=(0.0,), t_a2a_b=(0.0,))


class Unready(ScheduleError):
    """The round structure asked for a pass whose input no rank has produced yet."""


def v_round_orders(
    costs: CostModel, microbatches: int, limit: float | None, switches: VRoundSwitches, read: set[str] | None = None
) -> Result:
    """The best of repeated runs, each allowing the bubbles of the one before; raises NoRoom or Unready.

    ``read`` collects the switches some decision of the runs depended on (see ``RoundRuns``).
    """
    read = set() if read is None else read
    best = _VRounds(costs, microbatches, limit, switches, None, read).run()
    for _ in range(BUDGET.v_round_reruns):
        try:
            again = _VRounds(costs, microbatches, limit, switches, best.clock.idle, read).run()
        except (NoRoom, Unready):
            return Result.of_clock(best.clock)
        if max(again.clock.idle) >= max(best.clock.idle) - EPS:
            break
        best = again
    return Result.of_clock(best.clock)


class RoundRuns:
    """``v_round_orders`` for any switch setting, each distinct run once.

    A run whose ranks never met a long wait with a W pending never read its fill switches, so a
    setting that differs only in switches a run did not read plans the same orders (or fails
    the same way): that run's outcome is returned again instead of planning it anew.
    """

    def __init__(self, costs: CostModel, limit: float | None):
        self.costs, self.limit = costs, limit
        self.runs: dict[int, list[tuple[VRoundSwitches, set[str], Result | ScheduleError]]] = {}

    def __call__(self, microbatches: int, switches: VRoundSwitches) -> Result:
        runs = self.runs.setdefault(microbatches, [])
        alike = (run for other, read, run in runs if all(getattr(other, f) == getattr(switches, f) for f in read))
        outcome = next(alike, None)
        if outcome is None:
            read: set[str] = set()
            try:
                outcome = v_round_orders(self.costs, microbatches, self.limit, switches, read)
            except (NoRoom, Unready) as error:
                outcome = error
            runs.append((switches, read, outcome))
        if isinstance(outcome, ScheduleError):
            raise outcome
        return outcome


class _VRounds:
    def __init__(
        self,
        costs: CostModel,
        m: int,
        limit: float | None,
        switches: VRoundSwitches,
        allowed: list[float] | None,
        read: set[str],
    ):
        p = costs.pp
        self.p, self.m, self.sw, self.read = p, m, switches, read
        self.limit = float("inf") if limit is None else limit + EPS
        self.clock = Clock(model_of((v_shape(p),), m, costs))
        model = self.clock.model
        # per rank and pass (F0, F1, B1, B0, then W1, W0): the code of microbatch 0, then + k
        self.base = item_bases(p, m)
        # per rank and pass: what it takes, allocates, whether its input crosses ranks
        self.time = [[model.duration(c) for c in row] for row in self.base]
        self.delta = [[model.delta(c) for c in row] for row in self.base]
        self.remote = [[model.remote[c // m] for c in row] for row in self.base]
        self.count = [[0] * 4 for _ in range(p)]  # per rank and pass: how many ran
        self.known = [[-1.0] * 4 for _ in range(p)]  # when the next one's input arrives (-1: not known yet)
        self.pending: list[deque[tuple[int, float]]] = [deque() for _ in range(p)]  # (W code, its time), oldest first
        allowed = allowed or [0.0] * p
        self.allowance = [max(allowed) - a for a in allowed]

    def run(self) -> _VRounds:
        self._warm_up()
        for _ in range(2 * self.m):
            self._b_round()
            self._f_round()
        for r in range(self.p):
            while self.pending[r]:
                self._put_w(r)
        if any(sum(c) < 4 * self.m for c in self.count):
            raise Unready("the V rounds ended before every pass ran")
        return self

    # -- inputs -------------------------------------------------------------------------------
    def _input(self, r: int, kind: int) -> float:
        """When the input of rank r's next pass of this kind is ready (-1: not yet, or none left)."""
        known = self.known[r]
        if known[kind] < 0 and self.count[r][kind] < self.m:
            ready = self.clock.ready(self.base[r][kind] + self.count[r][kind])
            known[kind] = -1.0 if ready is None else ready  # once known, an arrival stays
        return known[kind]

    # -- placing passes -----------------------------------------------------------------------
    def _put(self, r: int, kind: int) -> None:
        if self.count[r][kind] >= self.m:
            raise Unready(f"rank {r} has no pass of kind {kind} left")
        code = self.base[r][kind] + self.count[r][kind]
        if self._input(r, kind) < 0:
            where = self.clock.model.encoding.decode(code)
            raise Unready(f"rank {r}: the input of block {where.stage} microbatch {where.microbatch} is not there")
        self._room(r, self.delta[r][kind])
        self.clock.place(code)
        self.count[r][kind] += 1
        self.known[r][kind] = -1.0
        if kind >= B1:
            self.pending[r].append((self.base[r][kind + 2] + code % self.m, self.time[r][kind + 2]))  # its W

    def _put_w(self, r: int) -> None:
        self.clock.place(self.pending[r].popleft()[0])

    def _room(self, r: int, delta: float) -> None:
        while self.clock.level[r] + delta > self.limit:
            if not self.pending[r]:
                raise NoRoom(f"rank {r} cannot fit its next pass under the memory limit")
            self._put_w(r)

    def _fill(self, r: int, kind: int, switch: str | None) -> None:
        """Run pending Ws while the rank waits for an input from another rank; one more on a long wait
        unless ``switch`` (a ``VRoundSwitches`` field) is off."""
        ready, clock = self._input(r, kind), self.clock
        if ready < 0 or not self.remote[r][kind]:
            return
        while self.pending[r] and ready >= clock.free[r] + self.pending[r][0][1] - EPS:
            self._put_w(r)
        budget = max(clock.most_idle, self.allowance[r]) - clock.idle[r]
        if self.pending[r] and ready - clock.free[r] > budget + EPS:
            if switch is not None:
                self.read.add(switch)
            if switch is None or getattr(self.sw, switch):
                self._put_w(r)

    def _step(self, r: int, kind: int, switch: str | None) -> None:
        self._room(r, self.delta[r][kind] if kind in (F0, F1) else 0.0)
        self._fill(r, kind, switch)
        self._put(r, kind)

    # -- phases -------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            self._put(r, F0)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                arrival = self._input(r, F1)
                reserve = self.delta[r][F0] * (2 + 2 * r)
                while (
                    self.count[r][F0] < m
                    and self.clock.level[r] + reserve <= self.limit
                    and self.clock.free[r] + self.time[r][F0] <= arrival + EPS
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
            elif r == p - 1 or c[B1] >= self.m or self._input(r, B0) >= 0:
                up.append(r)
            else:
                down.append(r)
        for r in reversed(up):
            self._step(r, B0, None)
        for r in down:
            self._step(r, B1, "fill_b")

    def _f_round(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            c = self.count[r]
            if c[F1] >= m:
                continue
            if c[F1] >= c[F0]:
                kind = F0
            elif r == p - 1 or self._input(r, F1) >= 0:
                kind = F1
            elif c[F0] < m and self._input(r, F0) >= 0:
                kind = F0
            else:
                continue
            if self._input(r, kind) < 0:
                continue
            self._step(r, kind, "fill_f")
