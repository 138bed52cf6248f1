"""Schedules from files: our JSON (``megatron-zb plan --format json``) or PyTorch's CSV.

``load_schedule(path)`` reads either (told apart by content: JSON starts with ``{``).
``build_schedule(name, spec)`` is what training calls: a registered name, or ``file:PATH``
for the orders in a file, which must be for the run's pp, microbatches and chunks. Either
way the result is validated, so a broken file never reaches the runtime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .ir import Pass, PassKind, Schedule, ScheduleError
from .placement import Placement, interleaved, linear, mirrored, v_shape
from .registry import ScheduleSpec, build
from .torch_csv import infer_placement, read_torch_csv
from .validate import check

FILE_PREFIX = "file:"
_PLACEMENTS = {"linear": lambda pp, chunks: linear(pp), "interleaved": interleaved, "v": v_shape}


@dataclass(frozen=True)
class LoadedSchedule:
    schedule: Schedule
    notes: list[str] = field(default_factory=list)  # what the reader dropped, and why


def load_schedule(path: str, name: str | None = None) -> LoadedSchedule:
    """The schedule in ``path`` (not yet validated); ScheduleError when it cannot be read."""
    name = name or Path(path).name
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ScheduleError(f"{path}: cannot read the schedule file ({reason})") from None
    if text.lstrip().startswith("{"):
        return LoadedSchedule(read_json(text, name))
    return LoadedSchedule(*read_torch_csv(text, name))


def read_json(text: str, name: str) -> Schedule:
    """The orders of ``plan --format json`` (times and other keys are ignored), with its overlapped pairs
    (the two passes that carry one ``"pair"`` number)."""
    try:
        data = json.loads(text)
        ranks = data["ranks"]
        orders = tuple(tuple(_pass(item) for item in rank) for rank in ranks)
        found = 1 + max((p.microbatch for order in orders for p in order), default=-1)
        microbatches = int(data.get("microbatches", found))
    except (ValueError, KeyError, TypeError) as error:
        raise ScheduleError(
            f"{name}: not a schedule as `megatron-zb plan --format json` writes it ({type(error).__name__}: {error}); "
            'expected {"ranks": [[{"pass": "F", "stage": 0, "microbatch": 0}, ...], ...]}'
        ) from None
    placements = _json_placements(name, data, ranks)
    return Schedule(name, placements, microbatches, orders, overlapped=_json_pairs(name, ranks, orders))


def _json_pairs(name: str, ranks: list, orders: tuple[tuple[Pass, ...], ...]) -> tuple[tuple[Pass, Pass], ...]:
    members: dict[object, list[Pass]] = {}
    for rank, order in zip(ranks, orders, strict=True):
        for item, p in zip(rank, order, strict=True):
            if "pair" in item:
                members.setdefault(item["pair"], []).append(p)
    pairs = []
    for number, found in members.items():
        kinds = sorted(p.kind.value for p in found)
        if len(found) != 2 or kinds not in (["B", "F"], ["BW", "F"]):
            raise ScheduleError(
                f'{name}: "pair": {number!r} marks {", ".join(map(str, found))}; an overlapped pair is one F and one '
                "B or BW, next to each other in one rank's order"
            )
        forward, backward = sorted(found, key=lambda p: p.kind is not PassKind.F)
        pairs.append((forward, backward))
    return tuple(pairs)


def _pass(item: dict) -> Pass:
    return Pass(PassKind(item["pass"]), int(item["stage"]), int(item["microbatch"]), int(item.get("pipe", 0)))


def _json_placements(name: str, data: dict, ranks: list) -> tuple[Placement, ...]:
    """The placements the file names, or the one its passes imply; its per-pass chunks must agree."""
    pp = len(ranks)
    if "pp" in data and data["pp"] != pp:
        raise ScheduleError(
            f'{name}: "pp" is {data["pp"]} but "ranks" holds the orders of {pp} ranks; a schedule file gives one '
            "order per pipeline rank (fix the file, or write it again with `megatron-zb plan --format json`)"
        )
    kinds = data.get("placement")
    if kinds is None:
        stage_rank = {int(item["stage"]): r for r, rank in enumerate(ranks) for item in rank}
        placements: tuple[Placement, ...] = (infer_placement(name, pp, stage_rank),)
    else:
        chunks = int(data.get("chunks", 1)) // max(1, len(kinds))
        placements = tuple(_named_placement(name, kind, pp, chunks) for kind in kinds)
        for later, kind in enumerate(kinds[1:], 1):
            if placements[later] != mirrored(placements[0]):
                raise ScheduleError(f"{name}: pipe {later} has placement {kind}; a second pipe mirrors the first")
    for r, rank in enumerate(ranks):
        for item in filter(lambda item: "chunk" in item, rank):
            pipe, stage = int(item.get("pipe", 0)), int(item["stage"])
            if pipe >= len(placements) or not 0 <= stage < placements[pipe].num_stages:
                continue  # the validator reports passes out of range
            if placements[pipe].chunk_of(stage) != int(item["chunk"]):
                raise ScheduleError(
                    f"{name}: rank {r} runs stage {stage} on chunk {item['chunk']}, but the {placements[pipe].kind} "
                    f"placement puts it on chunk {placements[pipe].chunk_of(stage)}"
                )
    return placements


def _named_placement(name: str, kind: str, pp: int, chunks: int) -> Placement:
    base = kind.removeprefix("mirrored-")
    if base not in _PLACEMENTS or (base == "linear" and chunks != 1):
        raise ScheduleError(f"{name}: unknown placement {kind!r} with {chunks} chunk(s) per rank")
    try:
        placement = _PLACEMENTS[base](pp, chunks)
    except ValueError as error:
        raise ScheduleError(f"{name}: {error}") from None
    return mirrored(placement) if kind != base else placement


def refuse_other_setting(source: str, schedule: Schedule, asked: dict[str, tuple[str, int | None]]) -> None:
    """ScheduleError naming both sides when a run asks for another setting than the file holds.

    ``asked`` maps ``pp``, ``microbatches`` and ``chunks`` to (how the run sets it, value or None).
    """
    holds = {"pp": schedule.pp, "microbatches": schedule.microbatches, "chunks": schedule.chunks}
    differ = [f"{how} gives {what}={value}" for what, (how, value) in asked.items() if value not in (None, holds[what])]
    if differ:
        raise ScheduleError(
            f"{source} holds a schedule for pp={schedule.pp}, microbatches={schedule.microbatches}, "
            f"chunks={schedule.chunks}, but {'; '.join(differ)}; plan a schedule for this setting "
            "(megatron-zb plan ... --format torch-csv or json) or change the setting"
        )


def build_schedule(name: str, spec: ScheduleSpec) -> Schedule:
    """A registered schedule for ``spec``, or the validated orders of ``file:PATH`` if they fit it."""
    if not name.startswith(FILE_PREFIX):
        return build(name, spec)
    schedule = load_schedule(name.removeprefix(FILE_PREFIX), name).schedule
    asked = {
        "pp": ("pp", spec.pp),
        "microbatches": ("microbatches", spec.microbatches),
        "chunks": ("chunks", spec.chunks),
    }
    refuse_other_setting(name, schedule, asked)
    check(schedule, spec.costs, spec.memory_limit)
    return schedule
