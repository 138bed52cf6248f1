"""BitPipe (Wu, Chen, Yu): two V-shaped pipelines in opposite directions on the same ranks.

Pipe 0 (A) is a V over 2pp blocks of half a stage, down the ranks and back (block r and block
2pp-1-r on rank r); pipe 1 (B) is its mirror image (block pp-1-r and block pp+r on rank r), so
every block exists twice, on ranks j and pp-1-j (``Schedule.shared``): the two copies start
equal and their gradients are averaged (REPLICA_SYNC, added by lowering) before every step.
Each direction carries half of the microbatches: A the first m/2, B the rest, disjoint.

``bitpipe`` is the reference implementation's order. Its four chunk queues per rank (A's and
B's first and second half) are consumed in loops of pp/2 microbatches per queue: a rank near
the middle interleaves the directions from the start, a rank at an end runs one direction
first. Execution per rank: ``warm`` forwards (1.5pp plus the rank's distance to the nearer
end), then 1F1B pairs; between loops a partial drain of backwards and a refill of forwards;
the cool-down drains the rest. The reference needs pp even and m a multiple of pp; other m
are refused, naming what works. With unit costs its bubble grows with m/pp (each loop's drain
and refill), so it wins at small m and loses to ZB-V and interleaved schedules at large m.

``bitpipe-zb`` runs the same F and B order with the backward split: each W goes into idle time
the plain order leaves, oldest first, the rest after the rank's last B, and under
``--memory-limit`` a W whose deferral would exceed the limit runs at once. When that is not
better than ``bitpipe`` (the same peak, its bubble), the W right after each B is kept, which
times exactly like ``bitpipe``: never worse.
"""

from __future__ import annotations

from collections import deque

from ..ir import BW, F, Pass, Schedule, ScheduleError
from ..placement import Placement, mirrored, v_shape
from ..registry import ScheduleSpec, register
from .moves import fill_idle, split_filled
from .search import Move


def check_setting(name: str, spec: ScheduleSpec) -> None:
    p, m = spec.pp, spec.microbatches
    if spec.chunks not in (None, 4):
        raise ScheduleError(f"{name} runs four chunks per rank (two per direction), got --chunks {spec.chunks}")
    if p < 2 or p % 2:
        raise ScheduleError(f"{name} needs an even pipeline size of at least 2 (mirrored rank pairs), got pp={p}")
    if m % p:
        low, high = (m // p) * p, (m // p + 1) * p
        hint = f"use {low} or {high}" if low else f"use {high}"
        raise ScheduleError(
            f"{name} needs microbatches divisible by pp={p} (each direction runs pp/2 per loop), got {m}; {hint}"
        )


def _queues(p: int, m: int, rank: int) -> list[list[tuple[int, int, int]]]:
    """The rank's four chunk queues (pipe, stage, microbatch): A first half, B first half, A second, B second."""
    half = m // 2
    a = range(half)
    b = range(half, m)
    return [
        [(0, rank, mb) for mb in a],
        [(1, p - 1 - rank, mb) for mb in b],
        [(0, 2 * p - 1 - rank, mb) for mb in a],
        [(1, p + rank, mb) for mb in b],
    ]


def _chunk_sequence(p: int, m: int, rank: int, backward: bool) -> list[int]:
    """Which queue each forward (or backward) of the rank takes, loop by loop (the reference's index tables)."""
    nu = p // 2
    ih = rank // nu
    ni = nu - rank if rank < nu else rank - nu + 1
    if backward:
        first, second, third, fourth = 2 + ih, 3 - ih, 1 - ih, ih
    else:
        first, second, third, fourth = ih, 1 - ih, 3 - ih, 2 + ih
    loop = (
        [first] * ni + [second, first] * (nu - ni) + [second, third] * ni + [fourth, third] * (nu - ni) + [fourth] * ni
    )
    return loop * (m // p)


def rank_order(p: int, m: int, rank: int) -> list[Pass]:
    """The reference's execution order of one rank: warm-up, loops of 1F1B with drain and refill, cool-down."""
    queues_f, queues_b = _queues(p, m, rank), _queues(p, m, rank)
    forwards = deque(
        F(stage, mb, pipe) for pipe, stage, mb in (queues_f[c].pop(0) for c in _chunk_sequence(p, m, rank, False))
    )
    backwards = deque(
        BW(stage, mb, pipe) for pipe, stage, mb in (queues_b[c].pop(0) for c in _chunk_sequence(p, m, rank, True))
    )
    total = 2 * m
    warm = min(p + p // 2 + min(rank, p - 1 - rank), total)
    steady = 2 * p - warm
    order: list[Pass] = [forwards.popleft() for _ in range(warm)]

    def pairs(count: int) -> None:
        for _ in range(count):
            order.extend((forwards.popleft(), backwards.popleft()))

    for _ in range(m // p - 1):
        pairs(steady)
        order.extend(backwards.popleft() for _ in range(warm - steady + 1))
        pairs(steady - 1)
        order.extend(forwards.popleft() for _ in range(warm - steady + 1))
    pairs(steady)
    order.extend(backwards)
    return order


def _placements(spec: ScheduleSpec) -> tuple[Placement, Placement]:
    down = v_shape(spec.pp, 2)
    return down, mirrored(down)


def _shared(spec: ScheduleSpec) -> tuple:
    return tuple(((0, block), (1, block)) for block in range(2 * spec.pp))


@register(
    "bitpipe",
    "BitPipe: two mirrored V pipelines, half the microbatches each, weights twice (pp even, m a multiple of pp)",
    weight_copies=2,
)
def generate(spec: ScheduleSpec) -> Schedule:
    check_setting("bitpipe", spec)
    p, m = spec.pp, spec.microbatches
    orders = tuple(tuple(rank_order(p, m, r)) for r in range(p))
    return Schedule("bitpipe", _placements(spec), m, orders, _shared(spec))


@register(
    "bitpipe-zb",
    "BitPipe with the backward split, Ws in its idle time under --memory-limit; never worse",
    options=("memory_limit",),
    weight_copies=2,
)
def generate_zb(spec: ScheduleSpec) -> Schedule:
    """BitPipe's order split (each W right after its B), and its Ws moved into idle time when that is better."""
    check_setting("bitpipe-zb", spec)
    costs, limit = spec.cost_model(), spec.memory_limit
    fill = Move(lambda result: fill_idle(result, costs, limit))
    return split_filled("bitpipe-zb", spec, generate(spec), fill)  # its shared blocks too
