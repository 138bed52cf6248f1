"""The schedule core: IR, generators, validator, simulator. Pure Python, never imports torch."""

from .comm import messages, program
from .costs import CostModel
from .ir import Pass, PassKind, Schedule, ScheduleError
from .iterations import IterationsTimeline, simulate_iterations
from .registry import ScheduleSpec, build, names, register
from .serialise import schedule_from_data, schedule_to_data
from .simulate import Timeline, simulate
from .validate import check, validate

__all__ = [
    "CostModel",
    "IterationsTimeline",
    "Pass",
    "PassKind",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "Timeline",
    "build",
    "check",
    "messages",
    "names",
    "program",
    "register",
    "schedule_from_data",
    "schedule_to_data",
    "simulate",
    "simulate_iterations",
    "validate",
]
