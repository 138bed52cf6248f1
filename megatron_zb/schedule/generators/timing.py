"""Fast timing of candidate orders, for ranking them inside the planner.

The same execution model as ``execute.py`` (each rank runs its passes in order; a pass starts
when its rank is free and its inputs have finished, plus T_comm across ranks), written on the
integer codes of result.py so that ranking dozens of candidates at pp=32, m=256 stays cheap.
``build`` still validates and the simulator still times the schedule that is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..costs import CostModel
from ..ir import Pass
from ..placement import Placement
from .result import CODE, Result, encode

_F, _B, _W, _BW = range(4)


def timed(orders: Sequence[Sequence[Pass]], placement: Placement, costs: CostModel, m: int) -> Result | None:
    """Stage span, makespan and peak memory of one-pipe orders; None if they deadlock."""
    n = placement.num_stages
    codes = [[encode(CODE[x.kind], x.stage, x.microbatch, n, m) for x in order] for order in orders]
    return timed_codes(codes, placement, costs, m)


def timed_codes(codes: list[list[int]], placement: Placement, costs: CostModel, m: int) -> Result | None:
    """``timed`` on encoded passes (result.py's ``encode``)."""
    n, c = placement.num_stages, placement.chunks
    rank = [placement.rank_of(s) for s in range(n)]
    full = [placement.full_stage(s) for s in range(n)]
    dur = [costs.t_f[f] / c for f in full] + [costs.t_b[f] / c for f in full] + [costs.t_w[f] / c for f in full]
    dur += [(costs.t_b[f] + costs.t_w[f]) / c for f in full]
    mem = [costs.mem_f[f] / c for f in full] + [costs.mem_b[f] / c for f in full] + [costs.mem_w[f] / c for f in full]
    mem += [-costs.mem_f[f] / c for f in full]
    comm, last, nm = costs.t_comm, n - 1, n * m
    end = [-1.0] * (2 * nm)  # F ends at s*m + k, B ends at nm + s*m + k
    p = len(codes)
    free, first, level, peak = [0.0] * p, [-1.0] * p, [0.0] * p, [0.0] * p
    at = [0] * p
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(codes):
            i, t = at[r], free[r]
            while i < len(order):
                code = order[i]
                ks, k = divmod(code, m)
                kind, s = divmod(ks, n)
                ready = t
                if kind == _F:
                    if s:
                        done = end[(s - 1) * m + k]
                        if done < 0:
                            break
                        done += comm if rank[s - 1] != r else 0.0
                        ready = max(ready, done)
                elif kind == _W:
                    done = end[nm + s * m + k]
                    if done < 0:
                        break
                    ready = max(ready, done)
                else:
                    done = end[s * m + k]
                    if done < 0:
                        break
                    ready = max(ready, done)
                    if s != last:
                        done = end[nm + (s + 1) * m + k]
                        if done < 0:
                            break
                        ready = max(ready, done + comm if rank[s + 1] != r else done)
                if first[r] < 0:
                    first[r] = ready
                t = ready + dur[ks]
                if kind == _F:
                    end[s * m + k] = t
                elif kind != _W:
                    end[nm + s * m + k] = t
                level[r] += mem[ks]
                if level[r] > peak[r]:
                    peak[r] = level[r]
                i += 1
            if i > at[r]:
                at[r], free[r], progress = i, t, True
    if any(i < len(order) for i, order in zip(at, codes, strict=True)):
        return None
    busy = [r for r in range(p) if codes[r]]
    span = max((free[r] - first[r] for r in busy), default=0.0)
    makespan = max(free) - min((first[r] for r in busy), default=0.0)
    return Result([list(order) for order in codes], n, m, span, makespan, max(peak))
