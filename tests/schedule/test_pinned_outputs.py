"""Every registered schedule's output on a grid of settings, pinned: nothing may get worse.

``golden/outputs.json`` holds, per setting (schedule, pp, microbatches, chunks, memory limit,
costs), a hash of the per-rank orders with the makespan, stage span and peak memory they
reach, or the first line of the refusal. A setting passes when its orders are the pinned ones,
or when they changed and the makespan got strictly shorter at no more peak memory and no longer
stage span (an improvement, say which in the change). A setting that ran may not be refused.

The grid mixes unit costs, the GPT-like stages of the benchmarks (heavier first and last
stage), the ZB paper's profile and a profile whose times and memory differ on every stage.
``MZB_PINNED_LARGE=1`` adds the planner benchmark's settings (pp 32 and 64; about a minute).
To rewrite the file after an intended change: ``python tests/schedule/test_pinned_outputs.py``, and review the diff.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.registry import ScheduleSpec, build
from megatron_zb.schedule.simulate import simulate

PINNED = Path(__file__).parent / "golden" / "outputs.json"
ALL = bool(os.environ.get("MZB_PINNED_ALL"))
TOLERANCE = 1e-9


def _gpt(p: int) -> CostModel:
    return CostModel(p, t_f=[1.2 if s in (0, p - 1) else 1.0 for s in range(p)], t_b=1.1, t_w=0.7, t_comm=0.05)


def _ends_heavier(p: int, w: float, comm: float) -> CostModel:
    scale = [1.2 if stage in (0, p - 1) else 1.0 for stage in range(p)]
    return CostModel(p, t_f=scale, t_b=[1.1 * x for x in scale], t_w=[w * x for x in scale], t_comm=comm)


COSTS = {
    "unit": CostModel,
    "gpt": _gpt,
    "gpt66": lambda p: _ends_heavier(p, 0.66, 0.03),
    "paper": lambda p: CostModel(p, t_f=18522, t_b=18086, t_w=9337, t_comm=601, mem_f=1, mem_b=-0.55, mem_w=-0.45),
    "ramp": lambda p: CostModel(
        p,
        t_f=[1.0 + 0.1 * s for s in range(p)],
        t_b=[1.3 - 0.05 * s for s in range(p)],
        t_w=0.7,
        t_comm=0.05,
        mem_f=[1.0 + 0.1 * s for s in range(p)],
        mem_b=[-0.6 - 0.05 * s for s in range(p)],
        mem_w=[-0.4 - 0.05 * s for s in range(p)],
    ),
}
Setting = tuple[str, int, int, int | None, float | None, str, int | None, bool]


def _grid() -> list[Setting]:
    """(schedule, pp, m, chunks, limit, costs, breadth-first group, post-validation)."""
    found: list[Setting] = []

    def add(name, p, m, chunks=None, limit=None, costs="unit", group=None, post=False):
        found.append((name, p, m, chunks, limit, costs, group, post))

    for p in (1, 2, 3, 4, 8):
        for m in sorted({1, max(1, p - 1), p, 2 * p + 1, 3 * p}):
            for name in ("1f1b", "zb-h1", "zb-h2"):
                add(name, p, m, costs="gpt")
            for costs in COSTS:
                for name, limits in (("zb-auto", (None, p, 1.5 * p)), ("zb-1p", (None,)), ("zb-2p", (None,))):
                    for limit in limits:
                        add(name, p, m, None, limit, costs)
    for p, m in ((2, 4), (3, 9), (4, 8), (4, 12), (4, 6), (8, 16), (8, 24)):
        for chunks in (2, 4):
            add("interleaved-1f1b", p, m, chunks, costs="gpt")
            for costs in ("unit", "gpt", "ramp"):
                for name, limit in (("zb-auto", None), ("zb-auto", p + 0.5), ("zb-1p", None), ("zb-2p", None)):
                    add(name, p, m, chunks, limit, costs)
        for chunks in (None, 1, 2, 4):
            for name in ("breadth-first", "breadth-first-zb"):
                add(name, p, m, chunks, costs="gpt")
                if m % 2 == 0:
                    add(name, p, m, chunks, costs="ramp", group=m // 2)
    for p in (2, 3, 4, 5, 6, 8):
        for m in sorted({1, p, 2 * p, 3 * p + 1}):
            for costs in COSTS:
                for name in ("zb-v", "v-half", "v-min"):
                    add(name, p, m, costs=costs)
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 12), (5, 10), (6, 12), (8, 24)):
        for costs in COSTS:
            for quarters in range(2 * p, 4 * p + 1, max(1, p // 2)):
                add("v-auto", p, m, limit=quarters / 4, costs=costs)
            add("v-auto", p, m, limit=None, costs=costs)
    for p, m in ((2, 4), (4, 8), (4, 16), (6, 12), (8, 16)):
        for costs in ("unit", "gpt", "ramp"):
            for limit in (None, p / 2, float(p)):
                add("bitpipe", p, m, costs=costs)
                add("bitpipe-zb", p, m, limit=limit, costs=costs)
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 12)):
        for costs in ("unit", "gpt", "paper"):
            for limit in (p / 2, 0.75 * p, float(p), 2.0 * p):
                for post in (False, True):
                    add("auto", p, m, limit=limit, costs=costs, post=post)
    for name, p, m in (("zb-1p", 3, 6), ("zb-2p", 3, 6), ("zb-1p", 4, 8), ("zb-2p", 4, 8), ("zb-v", 8, 24)):
        add(name, p, m, costs="paper")  # the CP-SAT optima and the reference's numbers of test_planner.py
    return list(dict.fromkeys(found))


def _large_grid() -> list[Setting]:
    """The planner benchmark's settings (scripts/bench_planner.py), paper profile."""
    found: list[Setting] = []
    for name, p, m, factor in (
        ("zb-1p", 32, 256, None),
        ("zb-2p", 32, 256, None),
        ("zb-v", 32, 256, None),
        ("v-half", 32, 256, None),
        ("v-min", 32, 256, None),
        ("v-auto", 32, 256, 0.5),
        ("v-auto", 32, 256, 0.75),
        ("v-auto", 32, 256, 1.0),
        ("zb-2p", 64, 512, None),
        ("zb-v", 64, 512, None),
        ("v-auto", 64, 512, 0.75),
        ("v-auto", 16, 48, 0.5),
        ("zb-2p", 16, 64, None),
        ("zb-auto", 16, 48, 1.5),
    ):
        found.append((name, p, m, None, None if factor is None else factor * p, "paper", None, False))
    return found


def _quick(setting: Setting) -> bool:
    """The part of the grid every test run checks: all but the slower automatic settings."""
    name, p, m, _, limit, costs, _, _ = setting
    if name == "v-auto":
        return (
            p <= 3 or (p in (4, 6) and costs in ("gpt", "ramp") and m == 2 * p) or (p, costs, limit) == (8, "paper", 6)
        )
    if name == "auto":
        return p <= 2 or (costs == "gpt" and p <= 4)
    if p == 8 and name in ("zb-v", "v-half", "v-min", "zb-auto", "zb-1p", "zb-2p"):
        return costs in ("unit", "paper")
    return True


def key(setting: Setting) -> str:
    name, p, m, chunks, limit, costs, group, post = setting
    text = f"{name} pp={p} m={m} chunks={chunks} limit={limit} costs={costs}"
    return text + (f" group={group}" if group else "") + (" post-validation" if post else "")


def outcome(setting: Setting) -> dict:
    name, p, m, chunks, limit, costs_label, group, post = setting
    costs = COSTS[costs_label](p)
    spec = ScheduleSpec(p, m, chunks, costs, limit, post_validation=post, breadth_first_microbatches=group)
    try:
        schedule = build(name, spec, suggest=False)
    except ScheduleError as error:
        return {"refused": str(error).splitlines()[0]}
    timeline = simulate(schedule, costs)
    return {
        "name": schedule.name,
        "orders": hashlib.sha256(schedule.to_text().encode()).hexdigest()[:20],
        "makespan": round(timeline.makespan, 9),
        "stage_span": round(timeline.stage_span, 9),
        "peak": round(max(timeline.peak_memory), 9),
    }


def _pinned() -> dict[str, dict]:
    return json.loads(PINNED.read_text()) if PINNED.exists() else {}


def _regenerate() -> None:
    found = {key(setting): outcome(setting) for setting in _grid() + _large_grid()}
    PINNED.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


def _check(setting: Setting) -> None:
    pinned = _pinned().get(key(setting))
    assert pinned is not None, f"{key(setting)} is not pinned; run this file as a script and review the diff"
    now = outcome(setting)
    if "refused" in pinned:
        return  # refused before: anything it does now is no worse
    assert "refused" not in now, f"{key(setting)} ran before and is refused now: {now['refused']}"
    if now == pinned:
        return
    assert now["peak"] <= pinned["peak"] + TOLERANCE, (key(setting), pinned, now)
    assert now["stage_span"] <= pinned["stage_span"] + TOLERANCE, (key(setting), pinned, now)
    assert now["makespan"] < pinned["makespan"] - TOLERANCE, ("orders changed without a shorter makespan", pinned, now)


@pytest.mark.parametrize("setting", [setting for setting in _grid() if _quick(setting)], ids=key)
def test_no_output_got_worse(setting: Setting):
    _check(setting)


@pytest.mark.skipif(not ALL, reason="set MZB_PINNED_ALL=1 (the slower settings, a few minutes)")
@pytest.mark.parametrize("setting", [s for s in _grid() if not _quick(s)] + _large_grid(), ids=key)
def test_no_slower_output_got_worse(setting: Setting):
    _check(setting)


if __name__ == "__main__":
    _regenerate()
