"""Shorten ranks' tails: the deferrable passes (Ws) a rank runs after its last awaited pass go into
idle gaps earlier in its timeline where they fit.

Planners leave each rank's cool-down ending in a run of Ws while, earlier, the rank waited for an
input with a W of its own ready. A W nothing waits for, run inside such a wait, ends before the
next pass's input arrives, so that pass, and every other pass of every rank, keeps its start:
the rank ends earlier by the W's time, and its memory drops sooner (no peak rises). The stage
span and the makespan can only shrink, which matters where the rank ending last is not the
longest one (the makespan then exceeds the stage span), as on V ranks that start late.
"""

from __future__ import annotations

from ..costs import CostModel
from ..timing import EPS, spans
from .result import Result, model_of, timed_codes


def sunk_tail(result: Result, costs: CostModel) -> Result | None:
    """``result`` with each rank's trailing deferrable passes moved, oldest first, into the earliest
    idle gaps of its timeline that hold them; None if no pass moved (or the orders deadlock)."""
    placements, m = result.encoding.placements, result.microbatches
    model = model_of(placements, m, costs)
    start = [-1.0] * model.encoding.size  # -1: a pass the orders do not hold
    if spans(model, result.codes, start) is None:
        return None
    writers: dict[int, list[int]] = {}  # role row -> the (kind, block)s playing it (B and a fused BW)
    for index, rows in enumerate(model.writes):
        for row in rows:
            writers.setdefault(row, []).append(index)

    def end(code: int) -> float:
        return start[code] + model.duration(code)

    def ready(code: int) -> float:
        """When its inputs have arrived (T_comm added across ranks)."""
        index, k = divmod(code, m)
        at = 0.0
        for row, cross in model.inputs[index]:
            for writer in writers[row]:
                if start[writer * m + k] >= 0.0:
                    at = max(at, end(writer * m + k) + (model.comm if cross else 0.0))
        return at

    orders, moved, times = [], False, model.time
    for order in result.codes:
        cut = len(order)
        while cut and not model.awaited[order[cut - 1] // m]:
            cut -= 1
        queue = [(w, ready(w), model.duration(w)) for w in order[cut:]]
        inserts: list[tuple[int, list[int]]] = []  # (before position, the Ws run in the wait there)
        shortest = min((t for _, _, t in queue), default=0.0)
        for i in range(1, cut):
            if not queue:
                break
            before = order[i - 1]
            free, wait_ends = start[before] + times[before // m], start[order[i]]
            if wait_ends - free < shortest - EPS:
                continue
            gap, left = [], []
            for w, arrives, t in queue:
                at = max(free, arrives)
                if at + t <= wait_ends + EPS:
                    gap.append(w)
                    free = at + t
                else:
                    left.append((w, arrives, t))
            if gap:
                inserts.append((i, gap))
                queue, shortest = left, min((t for _, _, t in left), default=0.0)
        if not inserts:
            orders.append(order)
            continue
        moved, filled, done = True, [], 0
        for i, gap in inserts:
            filled += order[done:i] + gap
            done = i
        orders.append(filled + order[done:cut] + [w for w, _, _ in queue])
    return timed_codes(orders, placements, costs, m) if moved else None
