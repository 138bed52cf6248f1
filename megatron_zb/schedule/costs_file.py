"""Measured costs saved by a training run, read back by ``megatron-zb plan --costs-from``.

A JSON file holds one ``CostModel`` (times in milliseconds per full stage) and the setting it
was measured in (schedule, pp, microbatches, chunks, memory limit, timed iterations), so a
user can study other schedules and limits for their own model offline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .costs import ALL_TO_ALL, ENDS, OWN_ENDS, CostModel
from .ir import ScheduleError

FORMAT = "megatron-zb costs 1"
_COST_FIELDS = ("t_f", "t_b", "t_w", "t_comm", "mem_f", "mem_b", "mem_w")
# What the first and last block add (``CostModel.t_f_ends``) and the expert-parallel all-to-alls
# (``CostModel.t_a2a``, ``t_a2a_b``), and the share of it an overlapped F&B pair hides
# (``CostModel.overlap``), and a fused BW's own time (``CostModel.t_bw``, written where it was
# measured); files written before them have none.
_OPTIONAL_FIELDS = (*ENDS.values(), *ALL_TO_ALL, "overlap", *OWN_ENDS, *OWN_ENDS.values())


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
        costs = {name: getattr(self.costs, name) for name in _COST_FIELDS + _OPTIONAL_FIELDS}
        costs = {name: value for name, value in costs.items() if value is not None}
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
    """The file's costs and setting; ScheduleError naming the file and the field when it is not one of ours."""
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
        return _measured(data)
    except ScheduleError as error:
        raise ScheduleError(f"--costs-from {path}: {error}") from None


def _measured(data: dict) -> MeasuredCosts:
    costs = data.get("costs")
    if not isinstance(costs, dict):
        raise ScheduleError('"costs" must be an object with ' + ", ".join(f'"{name}"' for name in _COST_FIELDS))
    missing = [name for name in _COST_FIELDS if name not in costs]
    if missing:
        raise ScheduleError(f'"costs" lacks {", ".join(repr(name) for name in missing)}')
    pp = _whole(data, "pp")
    if pp is None:
        raise ScheduleError('"pp" is missing: the pipeline size the costs were measured at')
    present = _COST_FIELDS + tuple(name for name in _OPTIONAL_FIELDS if name in costs)
    model = CostModel(pp, **{name: _value(name, costs[name]) for name in present})
    memory_limit = data.get("memory_limit")
    if memory_limit is not None and not (_is_number(memory_limit) and math.isfinite(memory_limit) and memory_limit > 0):
        raise ScheduleError(f'"memory_limit" must be a finite number > 0 or null, got {memory_limit!r}')
    schedule = data.get("schedule")
    if schedule is not None and not isinstance(schedule, str):
        raise ScheduleError(f'"schedule" must be a schedule name or null, got {schedule!r}')
    iterations = data.get("iterations")
    if iterations is not None and not (
        isinstance(iterations, list) and len(iterations) == 2 and all(_is_whole(v) for v in iterations)
    ):
        raise ScheduleError(f'"iterations" must be [first, last] timed iterations or null, got {iterations!r}')
    known = {"format", "unit", "pp", "costs", "schedule", "microbatches", "chunks", "memory_limit", "iterations"}
    return MeasuredCosts(
        model,
        schedule=schedule,
        microbatches=_whole(data, "microbatches"),
        chunks=_whole(data, "chunks"),
        memory_limit=memory_limit,
        iterations=tuple(iterations) if iterations else None,
        extra={key: value for key, value in data.items() if key not in known},
    )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(data: dict, name: str) -> int | None:
    """A count of the file: a whole number >= 1, or absent/null."""
    value = data.get(name)
    if value is not None and (not _is_whole(value) or value < 1):
        raise ScheduleError(f'"{name}" must be a whole number >= 1, got {value!r}')
    return value


def _value(name: str, value):
    """A cost: a number or a list of numbers (CostModel checks they are finite and in range)."""
    if _is_number(value):
        return float(value)
    if isinstance(value, list) and value and all(_is_number(v) for v in value):
        return tuple(float(v) for v in value)
    raise ScheduleError(f'"costs"."{name}" must be a number or a list of numbers, got {value!r}')
