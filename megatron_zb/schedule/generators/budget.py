"""How much work the automatic planners may do: every bound on planning time, in one place.

Each bound counts passes scheduled or timed, or candidates tried, never seconds, so a plan is
the same on every machine. The defaults keep zb-2p and zb-v at pp=32, m=256 under a second and
v-auto at pp=64, m=512 within a few seconds (docs/bench_planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SearchBudget:
    eval_passes: int = 12_000  # above this many passes, planners are ranked on fewer microbatches ...
    confirm: int = 2  # ... and this many of them (distinct sample scores) are then planned for all


@dataclass(frozen=True)
class PolishBudget:
    passes: int = 400_000  # passes timed in all, over the candidates tried
    min_tries: int = 20  # fewer tries than this rarely help: then no polish
    max_tries: int = 400


@dataclass(frozen=True)
class VAutoBudget:
    ladder_passes: int = 50_000  # passes the ladder of list-scheduler caps may schedule
    # the blocks: settings whose every block screens within this many passes screen them all ...
    small_screen_passes: int = 160_000
    # ... others the levels up to this many stages of memory below the highest that fits, from the top down,
    screen_window: float = 1.0
    screen_passes: int = 200_000  # within this many passes screened (one block at least),
    large_screen_passes: int = 50_000  # or this many where all microbatches are planned by stretching fewer
    finalists: int = 3  # blocks per peak then planned for all microbatches (distinct screening times)


@dataclass(frozen=True)
class Budget:
    search: SearchBudget = field(default_factory=SearchBudget)
    polish: PolishBudget = field(default_factory=PolishBudget)
    v_auto: VAutoBudget = field(default_factory=VAutoBudget)
    v_round_reruns: int = 8  # zb-v's rounds rerun with the previous run's bubbles as allowances, while that helps


BUDGET = Budget()
