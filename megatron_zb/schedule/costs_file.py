"""Measured costs saved by a training run, read back by ``megatron-zb plan --costs-from``.

A JSON file holds one ``CostModel`` (times in milliseconds per full stage) and the setting it
was measured in (schedule, pp, microbatches, chunks, memory limit, timed iterations), so a
user can study other schedules and limits for their own model offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .costs import CostModel
from .ir import ScheduleError

FORMAT = "megatron-zb costs 1"
_COST_FIELDS = ("t_f", "t_b", "t_w", "t_comm", "mem_f", "mem_b", "mem_w")


@dataclass(frozen=True)
class MeasuredCosts:
    costs: CostModel
    schedule: str | None = None
    microbatches: int | None = None
    chunks: int | None = None
    memory_limit: float | None = None
    iterations: tuple[int, int] | None = None
    extra: dict = field(default_factory=dict)  # e.g. the re-planning's predicted bubbles

    def to_dict(self) -> dict:
        costs = {name: getattr(self.costs, name) for name in _COST_FIELDS}
        return {
            "format": FORMAT,
            "unit": "ms",
            "pp": self.costs.pp,
            "costs": {name: list(value) if isinstance(value, tuple) else value for name, value in costs.items()},
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "memory_limit": self.memory_limit,
            "iterations": list(self.iterations) if self.iterations else None,
            **self.extra,
        }


def save_costs(path: str | Path, measured: MeasuredCosts) -> None:
    Path(path).write_text(json.dumps(measured.to_dict(), indent=1) + "\n", encoding="utf-8")


def load_costs(path: str | Path) -> MeasuredCosts:
    """The file's costs and setting; ScheduleError naming the file when it is not one of ours."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScheduleError(f"--costs-from {path}: no such file") from None
    except (OSError, ValueError) as error:
        raise ScheduleError(f"--costs-from {path}: not a JSON costs file ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ScheduleError(
            f'--costs-from {path}: not a megatron-zb costs file (expected "format": "{FORMAT}"); '
            "write one with the training flag --zero-bubble-save-costs FILE"
        )
    try:
        costs = CostModel(int(data["pp"]), **{name: _value(data["costs"][name]) for name in _COST_FIELDS})
    except (KeyError, TypeError, ValueError) as error:
        raise ScheduleError(f"--costs-from {path}: incomplete costs ({error!r} missing or malformed)") from None
    iterations = data.get("iterations")
    known = {"format", "unit", "pp", "costs", "schedule", "microbatches", "chunks", "memory_limit", "iterations"}
    return MeasuredCosts(
        costs,
        schedule=data.get("schedule"),
        microbatches=data.get("microbatches"),
        chunks=data.get("chunks"),
        memory_limit=data.get("memory_limit"),
        iterations=tuple(iterations) if iterations else None,
        extra={key: value for key, value in data.items() if key not in known},
    )


def _value(value):
    return tuple(float(v) for v in value) if isinstance(value, list) else float(value)
