"""Fast timing of candidate orders, for ranking them inside the planner.

The same execution model as ``execute.py`` (each rank runs its passes in order; a pass starts
when its rank is free and its inputs have finished, plus T_comm across ranks), written on
integer ids so that ranking dozens of candidates at pp=32, m=256 stays cheap. ``build``
still validates and the simulator still times the schedule that is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..costs import CostModel
from ..ir import Pass, PassKind
from ..placement import Placement
from .result import Result

_F, _B, _W = 0, 1, 2


def timed(orders: Sequence[Sequence[Pass]], placement: Placement, costs: CostModel, m: int) -> Result | None:
    """Stage span, makespan and peak memory of one-pipe orders; None if they deadlock."""
    n, c = placement.num_stages, placement.chunks
    rank = [placement.rank_of(s) for s in range(n)]
    full = [placement.full_stage(s) for s in range(n)]
    dur = {
        PassKind.F: [costs.t_f[f] / c for f in full],
        PassKind.B: [costs.t_b[f] / c for f in full],
        PassKind.W: [costs.t_w[f] / c for f in full],
        PassKind.BW: [(costs.t_b[f] + costs.t_w[f]) / c for f in full],
    }
    mem = {
        PassKind.F: [costs.mem_f[f] / c for f in full],
        PassKind.B: [costs.mem_b[f] / c for f in full],
        PassKind.W: [costs.mem_w[f] / c for f in full],
        PassKind.BW: [-costs.mem_f[f] / c for f in full],
    }
    comm, last = costs.t_comm, n - 1
    end = [None] * (3 * n * m)  # (role, stage, microbatch) -> (end time, rank)
    p = len(orders)
    free, first, level, peak = [0.0] * p, [None] * p, [0.0] * p, [0.0] * p
    at = [0] * p
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            i, t = at[r], free[r]
            while i < len(order):
                x = order[i]
                kind, s, k = x.kind, x.stage, x.microbatch
                if kind is PassKind.F:
                    need = ((_F, s - 1),) if s else ()
                elif kind is PassKind.W:
                    need = ((_B, s),)
                else:
                    need = ((_F, s),) if s == last else ((_F, s), (_B, s + 1))
                ready = t
                for role, src in need:
                    done = end[(role * n + src) * m + k]
                    if done is None:
                        break
                    ready = max(ready, done + comm if rank[src] != r else done)
                else:
                    if first[r] is None:
                        first[r] = ready
                    t = ready + dur[kind][s]
                    if kind is not PassKind.W:
                        end[((_F if kind is PassKind.F else _B) * n + s) * m + k] = t
                    level[r] += mem[kind][s]
                    if level[r] > peak[r]:
                        peak[r] = level[r]
                    i += 1
                    continue
                break
            if i > at[r]:
                at[r], free[r], progress = i, t, True
    if any(i < len(order) for i, order in zip(at, orders, strict=True)):
        return None
    starts = [f for f in first if f is not None]
    span = max((free[r] - first[r] for r in range(p) if first[r] is not None), default=0.0)
    return Result.of_passes(orders, n, m, span, max(free) - min(starts, default=0.0), max(peak))
