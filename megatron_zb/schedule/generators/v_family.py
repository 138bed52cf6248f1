"""The V-shape family (controllable-memory paper): zb-v, v-half, v-min and v-auto.

All run on the V placement (rank r holds blocks r and 2pp-1-r, each half a stage), so every
rank holds one early and one late block and memory is balanced across ranks.

- v-min and v-half repeat a building block every 6 slots: the offsets of F0, F1, B1, B0 of
  rank i come from the paper (below); each W goes in the first free slot after its B. The
  block's lifespan bounds peak memory at about a third (v-min) or half (v-half) of 1f1b's.
  Sorting the slots gives the per-rank order; running it as soon as possible squeezes out
  the empty slots. With real costs the list scheduler, capped at the block's peak, may find
  a shorter order, and the better of the two is kept.
- v-auto runs the list scheduler on the V placement under a ladder of limits up to
  --memory-limit (see search.laddered), so more memory never gives a worse schedule.
- zb-v is v-auto at 1f1b's peak memory: about zero bubble for m >= 2pp.
"""

from __future__ import annotations

from ..ir import B, F, Pass, Schedule, ScheduleError, W
from ..placement import v_shape
from ..registry import ScheduleSpec, register
from ..simulate import memory_levels
from .greedy import ALL_SWITCHES
from .search import laddered, searched

SLOTS = 6  # one F, B and W on each of the two chunks
V_SWITCHES = tuple(s for s in ALL_SWITCHES if s.depth_first)  # breadth-first never won on the V


def v_min_offsets(p: int, i: int) -> list[int]:
    delta = 2 if p % 3 == 0 else 0
    return [i, 2 * p - i - 1, 2 * p + delta + i, 4 * p + delta - i - 1]


def v_half_offsets(p: int, i: int) -> list[int]:
    delta = 3 if p % 2 == 0 else 0
    return [2 * i, 3 * p - i - 2, 3 * p + delta + 2 * i - 1, 6 * p + delta - i - 2]


def block_orders(p: int, m: int, offsets) -> list[list[Pass]]:
    """Repeat the building block for every microbatch and read off each rank's order."""
    orders = []
    for rank in range(p):
        f0, f1, b1, b0 = offsets(p, rank)
        used = {slot % SLOTS for slot in (f0, f1, b1, b0)}
        if len(used) != 4:
            raise ScheduleError(f"building block offsets {offsets(p, rank)} collide for pp={p}, rank {rank}")
        w1 = _next_free(b1, used)
        w0 = _next_free(b0, used | {w1 % SLOTS})
        early, late = rank, 2 * p - 1 - rank
        slots = []
        for mb in range(m):
            base = SLOTS * mb
            slots += [
                (base + f0, F(early, mb)),
                (base + f1, F(late, mb)),
                (base + b1, B(late, mb)),
                (base + b0, B(early, mb)),
                (base + w1, W(late, mb)),
                (base + w0, W(early, mb)),
            ]
        orders.append([p_ for _, p_ in sorted(slots)])
    return orders


def _next_free(after: int, used: set[int]) -> int:
    slot = after + 1
    while slot % SLOTS in used:
        slot += 1
    return slot


def _v_spec(name: str, spec: ScheduleSpec) -> None:
    if spec.chunks not in (None, 2):
        raise ScheduleError(f"{name} runs two chunks per rank (the V), got --chunks {spec.chunks}")


def block_schedule(name: str, spec: ScheduleSpec, offsets) -> Schedule:
    orders = block_orders(spec.pp, spec.microbatches, offsets)
    return Schedule(name, (v_shape(spec.pp),), spec.microbatches, tuple(map(tuple, orders)))


def building_block(name: str, spec: ScheduleSpec, offsets) -> Schedule:
    _v_spec(name, spec)
    block = block_schedule(name, spec, offsets)
    peak = max(max((0.0, *levels)) for levels in memory_levels(block, spec.cost_model()))
    return searched(name, spec, block.placement, peak, seeds=[block], switches=V_SWITCHES)


def one_f_one_b_peak(spec: ScheduleSpec) -> float:
    """1f1b's peak: rank r holds min(pp-r, m) microbatches of its stage."""
    mem_f = spec.cost_model().mem_f
    return max(min(spec.pp - r, spec.microbatches) * mem_f[r] for r in range(spec.pp))


@register("v-min", "V-shape building block at about a third of 1f1b's memory (pp/3+1 stages)")
def generate_v_min(spec: ScheduleSpec) -> Schedule:
    return building_block("v-min", spec, v_min_offsets)


@register("v-half", "V-shape building block at about half of 1f1b's memory (pp/2+1 stages)")
def generate_v_half(spec: ScheduleSpec) -> Schedule:
    return building_block("v-half", spec, v_half_offsets)


@register("v-auto", "V-shape list schedule under --memory-limit (any limit from v-min's to zb-v's)")
def generate_v_auto(spec: ScheduleSpec) -> Schedule:
    _v_spec("v-auto", spec)
    placement = v_shape(spec.pp)
    seeds = [block_schedule("v-auto", spec, offsets) for offsets in (v_min_offsets, v_half_offsets)]
    return laddered("v-auto", spec, placement, spec.memory_limit, seeds)


@register("zb-v", "zero bubble V: 1f1b's memory, about zero bubble for m >= 2pp, twice the PP messages")
def generate_zb_v(spec: ScheduleSpec) -> Schedule:
    _v_spec("zb-v", spec)
    return searched("zb-v", spec, v_shape(spec.pp), one_f_one_b_peak(spec), switches=V_SWITCHES)
