"""Validator: every pass exactly once, on its rank, after its inputs, without deadlock,
within the memory limit. Each issue names the rank, the pass, its microbatch and the rule.

Per-stage actions (lowering's gathers, releases and gradient reductions) are checked too:
numbered in order, windows opened before they are closed, no pass on released weights, a
reduction after every weight gradient of its stage; and the all-to-alls split out of passes:
each once, on its pass's rank, before its pass. The two passes of an overlapped pair
(``Schedule.overlapped``, which checks their kinds and adjacency) must not depend on each other,
directly or through other ranks: they run as one step. Memory is checked per pass, in order, a
pair's two passes included.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from .actions import spec
from .costs import CostModel
from .deps import Role, inputs, order_inputs, roles
from .execute import DeadlockError, execute
from .ir import Pass, PassKind, Schedule, ScheduleError
from .simulate import memory_levels
from .timing import ROLES, Encoding, Model, run

MEMORY_TOLERANCE = 1e-9
MAX_REPORTED = 12


@dataclass(frozen=True)
class Issue:
    rule: str  # placement | range | once | missing | order | sharded | actions | pair | deadlock | memory
    message: str
    rank: int | None = None
    pass_: Pass | None = None

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def validate(schedule: Schedule, costs: CostModel | None = None, memory_limit: float | None = None) -> list[Issue]:
    if _runs_clean(schedule):  # the common case, checked fast; any doubt takes the full path below
        issues: list[Issue] = []
    else:
        issues = _full_issues(schedule)
    if memory_limit is not None and not any(i.rule in ("placement", "range") for i in issues):
        issues += _memory_issues(schedule, costs or CostModel(schedule.pp), memory_limit)
    return issues


def _full_issues(schedule: Schedule) -> list[Issue]:
    """Every rule but memory, each issue with its message."""
    issues = _placement_issues(schedule)
    if not issues:
        issues = _coverage_issues(schedule) + _action_issues(schedule) + _order_issues(schedule)
    if not issues:
        issues = _pair_issues(schedule)
    if not issues:
        try:
            execute(schedule, lambda p: 0.0)
        except DeadlockError as error:
            issues.append(Issue("deadlock", str(error), rank=min(error.waits), pass_=error.waits[min(error.waits)][0]))
    return issues


def _runs_clean(schedule: Schedule) -> bool:
    """Whether a schedule of compute passes only has no issue but memory, on integer codes.

    True only where ``_full_issues`` finds none: every pass in range and on its rank, each
    (role, stage, microbatch) once with each microbatch on one pipe, and the orders run to the
    end in the timing model with zero costs (which rules out a pass before its input on its own
    rank, and deadlocks). False sends the schedule down the full path, which names the issues.
    """
    if schedule.overlapped:  # the timing model runs one pass at a time
        return False
    m, placements = schedule.microbatches, schedule.placements
    model = _zero_model(placements, m)
    kind_of, writes, base, blocks = model.encoding.kinds, model.writes, model.encoding.base, model.encoding.blocks
    owner = [placements[pipe].rank_of(stage) for pipe, stage in model.encoding.where]
    stages = [placement.num_stages for placement in placements]
    pipe_of = [-1] * m
    seen = bytearray(model.roles)
    coded: list[list[int]] = []
    for rank, order in enumerate(schedule.orders):
        row = []
        for p in order:
            kind, stage, mb, pipe = kind_of.get(p.kind), p.stage, p.microbatch, p.pipe
            if kind is None or not (0 <= pipe < len(stages) and 0 <= mb < m and 0 <= stage < stages[pipe]):
                return False
            block = base[pipe] + stage
            if owner[block] != rank or pipe_of[mb] not in (-1, pipe):
                return False
            pipe_of[mb] = pipe
            index = kind * blocks + block
            for role in writes[index]:
                if seen[role + mb]:
                    return False
                seen[role + mb] = 1
            row.append(index * m + mb)
        coded.append(row)
    if -1 in pipe_of or sum(len(ROLES) * placements[pipe].num_stages for pipe in pipe_of) != sum(seen):
        return False  # a role is missing
    return run(model, coded) is not None


@lru_cache(maxsize=16)
def _zero_model(placements: tuple, microbatches: int) -> Model:
    return Model(Encoding(placements, microbatches))


def check(schedule: Schedule, costs: CostModel | None = None, memory_limit: float | None = None) -> None:
    """Raise ScheduleError listing the issues, if any."""
    issues = validate(schedule, costs, memory_limit)
    if issues:
        shown = [f"  {issue}" for issue in issues[:MAX_REPORTED]]
        if len(issues) > MAX_REPORTED:
            shown.append(f"  ... and {len(issues) - MAX_REPORTED} more")
        head = f"schedule {schedule.name} (pp={schedule.pp}, microbatches={schedule.microbatches}) is invalid:"
        raise ScheduleError("\n".join([head, *shown]))


def _placement_issues(schedule: Schedule) -> list[Issue]:
    issues = []
    for rank, order in enumerate(schedule.orders):
        for p in order:
            if not 0 <= p.pipe < len(schedule.placements):
                issues.append(Issue("range", f"rank {rank} runs {p}: no pipe {p.pipe}", rank, p))
            elif not 0 <= p.stage < schedule.num_stages(p.pipe):
                issues.append(Issue("range", f"rank {rank} runs {p}: no stage {p.stage}", rank, p))
            elif not p.kind.per_microbatch:
                if p.microbatch < 0:
                    issues.append(Issue("range", f"rank {rank} runs {p}: occurrence below 0", rank, p))
                elif schedule.rank_of(p) != rank:
                    where = schedule.rank_of(p)
                    message = f"rank {rank} runs {p}, but the placement puts stage {p.stage} on rank {where}"
                    issues.append(Issue("placement", message, rank, p))
            elif not 0 <= p.microbatch < schedule.microbatches:
                issues.append(
                    Issue("range", f"rank {rank} runs {p}: microbatch outside 0..{schedule.microbatches - 1}", rank, p)
                )
            elif schedule.rank_of(p) != rank:
                issues.append(
                    Issue(
                        "placement",
                        f"rank {rank} runs {p}, but the placement puts stage {p.stage} on rank {schedule.rank_of(p)}",
                        rank,
                        p,
                    )
                )
    return issues


def _coverage_issues(schedule: Schedule) -> list[Issue]:
    issues = []
    count: Counter[Role] = Counter()
    pipe_of: dict[int, int] = {}
    for rank, order in enumerate(schedule.orders):
        for p in order:
            count.update(roles(p))
            if not p.kind.is_compute:
                continue
            if pipe_of.setdefault(p.microbatch, p.pipe) != p.pipe:
                message = f"microbatch {p.microbatch} runs on pipes {pipe_of[p.microbatch]} and {p.pipe}"
                issues.append(Issue("once", message, rank, p))
    for mb in range(schedule.microbatches):
        pipe = pipe_of.get(mb, 0)
        for stage in range(schedule.num_stages(pipe)):
            rank = schedule.placements[pipe].rank_of(stage)
            for kind in ROLES:
                role = Role(kind, pipe, stage, mb)
                if count[role] == 0:
                    issues.append(Issue("missing", f"missing {role}: rank {rank} never runs it", rank))
                elif count[role] > 1:
                    issues.append(Issue("once", f"rank {rank} runs {role} {count[role]} times", rank))
    return issues


def _action_issues(schedule: Schedule) -> list[Issue]:
    """Per-stage actions: each occurrence once and numbered in order, gathers and releases alternating;
    parts of passes (all-to-alls) once each."""
    issues = []
    parts = Counter(p for order in schedule.orders for p in order if spec(p.kind).part_of)
    for p, count in parts.items():
        if count > 1:
            issues.append(Issue("once", f"{p} runs {count} times; a pass's all-to-all is split out of it once"))
    for rank, order in enumerate(schedule.orders):
        seen: dict[tuple, int] = {}  # (kind, pipe, stage) -> occurrences so far
        gathered: dict[tuple[int, int], Pass] = {}
        for i, p in enumerate(order):
            kind = spec(p.kind)
            if p.kind.per_microbatch:
                continue
            key = (p.pipe, p.stage)
            expected = seen.get((p.kind, p.pipe, p.stage), 0)
            seen[p.kind, p.pipe, p.stage] = expected + 1
            if p.microbatch != expected:
                message = f"rank {rank} runs {p} (pass {i}) as occurrence {expected} of {p.kind.value} s{p.stage}"
                issues.append(Issue("actions", message + "; number them 0, 1, ... in order", rank, p))
            if kind.gathers > 0 and key in gathered:
                message = f"rank {rank} runs {p} (pass {i}) while {gathered[key]} still holds s{p.stage}'s weights"
                issues.append(Issue("actions", message, rank, p))
            elif kind.gathers > 0:
                gathered[key] = p
            elif kind.gathers < 0 and gathered.pop(key, None) is None:
                message = f"rank {rank} runs {p} (pass {i}) with no gathered weights of stage {p.stage} to release"
                issues.append(Issue("actions", message, rank, p))
    reductions = Counter(
        (p.pipe, p.stage) for order in schedule.orders for p in order if p.kind is PassKind.REDUCE_GRAD
    )
    for (pipe, stage), count in reductions.items():
        if count > 1:
            what = Pass(PassKind.REDUCE_GRAD, stage, 0, pipe)
            issues.append(Issue("once", f"{what} runs {count} times; a stage's gradients are reduced once"))
    return issues


def _order_issues(schedule: Schedule) -> list[Issue]:
    issues = []
    from_order = order_inputs(schedule)
    for rank, order in enumerate(schedule.orders):
        for i in from_order.sharded[rank]:
            p = order[i]
            message = (
                f"rank {rank} runs {p} (pass {i}) on released weights: no UNSHARD s{p.stage} opens a window "
                "before it (gather the weights first)"
            )
            issues.append(Issue("sharded", message, rank, p))
        position: dict[Role, int] = {}
        for i, p in enumerate(order):
            for role in roles(p):
                position.setdefault(role, i)
        for i, p in enumerate(order):
            for role in inputs(p, schedule.num_stages(p.pipe)) + from_order.inputs[rank][i]:
                if position.get(role, -1) > i:
                    issues.append(
                        Issue(
                            "order",
                            f"rank {rank} runs {p} (pass {i}) before its input {role} (pass {position[role]})",
                            rank,
                            p,
                        )
                    )
    return issues


def _pair_issues(schedule: Schedule) -> list[Issue]:
    """An overlapped pair whose passes depend on each other, directly or through others (it would never start)."""
    producer = {role: p for order in schedule.orders for p in order for role in roles(p)}
    issues = []
    for forward, backward in schedule.overlapped:
        if forward.microbatch != backward.microbatch:
            continue  # a pass's inputs are of its own microbatch: another microbatch's passes never feed it
        for later, earlier in ((backward, forward), (forward, backward)):
            path = _needs(later, set(roles(earlier)), producer, schedule)
            if path:
                via = f" through {', '.join(map(str, path[1:-1]))}" if len(path) > 2 else ""
                rank = schedule.rank_of(forward)
                message = (
                    f"rank {rank}: overlapped pair ({forward}, {backward}): {later} needs {earlier}{via}; the two run "
                    "as one step, so pair an F and a B or BW that do not depend on each other (e.g. another microbatch)"
                )
                issues.append(Issue("pair", message, rank, forward))
    return issues


def _needs(p: Pass, targets: set[Role], producer: dict[Role, Pass], schedule: Schedule) -> list[Pass]:
    """The chain of passes from ``p`` back to one playing a role in ``targets`` through model inputs ([] if none)."""
    came_from: dict[Pass, Pass | None] = {p: None}
    stack = [p]
    while stack:
        current = stack.pop()
        for role in inputs(current, schedule.num_stages(current.pipe)):
            source = producer.get(role)
            if source is None or source in came_from:
                continue
            came_from[source] = current
            if role in targets:
                path = [source]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1]
            stack.append(source)
    return []


def _memory_issues(schedule: Schedule, costs: CostModel, limit: float) -> list[Issue]:
    issues = []
    for rank, levels in enumerate(memory_levels(schedule, costs)):
        for i, level in enumerate(levels):
            if level > limit + MEMORY_TOLERANCE:
                p = schedule.orders[rank][i]
                issues.append(
                    Issue(
                        "memory",
                        f"rank {rank} holds {level:g} microbatch-stages of activations after {p} (pass {i}), "
                        f"over the memory limit {limit:g}; this rank peaks at {max(levels):g}",
                        rank,
                        p,
                    )
                )
                break
    return issues
