"""The number rules that both routes apply: megatron-zb's own launcher and Megatron-LM's parsed arguments.

The ranges, and what each number means, are the flag table's (``flags/``); here they are applied to a
parsed namespace. ``training.checks`` (every flag of ``megatron-zb train``) and ``megatron.args`` (the
zero-bubble flags in Megatron-LM's namespace) both refuse a number this way, and name flags the same
way. Each refusal is a ValueError that names the flag, the value and what would work. Pure Python: no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from .flags.launcher import LAUNCHER_FLAGS
from .flags.table import Flag
from .flags.zero_bubble import ZERO_BUBBLE_FLAGS

TRAIN_FLAGS = (*LAUNCHER_FLAGS, *ZERO_BUBBLE_FLAGS)  # megatron-zb train's, which include Megatron-LM's names
_ROWS = {row.name: row for row in TRAIN_FLAGS}
DEFAULT_TIMEOUT_S = 600.0  # Megatron-LM's --distributed-timeout-minutes default, 10
# megatron-zb's settings that only a megatron-zb schedule reads, with their defaults.
ZERO_BUBBLE_SETTINGS = {row.name: row.default for row in ZERO_BUBBLE_FLAGS if row.needs_schedule}


def row(name: str) -> Flag:
    """The table's row of a field of megatron-zb train's namespace."""
    return _ROWS[name]


def flag(name: str) -> str:
    """The option of a namespace field: Megatron-LM's, where its destination is not the option's own name."""
    return _ROWS[name].option if name in _ROWS else "--" + name.replace("_", "-")


def check_numbers(args: argparse.Namespace, rows: Iterable[Flag]) -> None:
    """The numbers ``args`` holds for ``rows``, as given: each in its row's range, or a ValueError naming the flag.

    Rows checked while parsing (``Flag.checked_when_parsed``) are not checked again; None is "not given".
    """
    for checked in rows:
        if checked.range is None or checked.checked_when_parsed:
            continue
        value = getattr(args, checked.name, None)
        if value is not None and value not in checked.range:
            raise ValueError(checked.out_of_range(value))


def check_zero_bubble_numbers(args: argparse.Namespace) -> None:
    """megatron-zb's own numbers; every route calls this (launcher, --megatron-lm, the patched pretrain_gpt)."""
    check_numbers(args, (row("distributed_timeout_minutes"), *ZERO_BUBBLE_FLAGS))
    check_timeouts(args)


def check_timeouts(args: argparse.Namespace) -> None:
    """One timeout bounds every wait: --distributed-timeout-minutes; --zero-bubble-p2p-timeout may only shorten it."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    p2p = getattr(args, "zero_bubble_p2p_timeout", None)
    if p2p is not None and minutes is not None and p2p > minutes * 60:
        raise ValueError(
            f"--zero-bubble-p2p-timeout {p2p:g} s is longer than --distributed-timeout-minutes {minutes:g} "
            f"({minutes * 60:g} s), which bounds every wait: it may only shorten it; give at most {minutes * 60:g} "
            "or raise --distributed-timeout-minutes"
        )


def wait_timeout_s(args: argparse.Namespace) -> float:
    """The timeout of a pipeline wait: --zero-bubble-p2p-timeout if given, else --distributed-timeout-minutes."""
    p2p = getattr(args, "zero_bubble_p2p_timeout", None)
    minutes = getattr(args, "distributed_timeout_minutes", None)
    default = 60.0 * minutes if minutes is not None else DEFAULT_TIMEOUT_S
    return min(p2p, default) if p2p is not None else default


def refuse_zero_bubble_settings(args: argparse.Namespace) -> None:
    """Without a megatron-zb schedule these change nothing: refused rather than silently ignored."""
    given = [name for name, default in ZERO_BUBBLE_SETTINGS.items() if getattr(args, name, default) != default]
    if given:
        raise ValueError(
            f"{flag(given[0])} applies to megatron-zb schedules only and would have no effect here; choose one "
            "(--enable-zero-bubble, --zero-bubble-v-schedule or --pipeline-schedule NAME) or drop the flag"
        )


def breadth_first_group(breadth: int | None, depth: int | None, microbatches: int, counted: str = "") -> int | None:
    """Microbatches per breadth-first group, from either knob (both: they must multiply to the microbatches).

    ``counted`` says how the microbatches were counted, after the count. That the group divides the
    microbatches is the breadth-first schedules' own check (``generators/breadth_first.group_size``).
    """
    if depth is not None and microbatches % depth:
        raise ValueError(
            f"--depth-first-micro-batches {depth} must divide the microbatches ({microbatches}){counted}: "
            "microbatches = breadth-first x depth-first micro-batches"
        )
    if breadth is not None and depth is not None and breadth * depth != microbatches:
        raise ValueError(
            f"--breadth-first-micro-batches {breadth} x --depth-first-micro-batches {depth} = {breadth * depth}, "
            f"not the {microbatches} microbatches{counted}; give one of them, or two that multiply to it"
        )
    return microbatches // depth if breadth is None and depth is not None else breadth


def first_set(source: object, names: Iterable[str]) -> str | None:
    """The first of ``names`` that ``source`` has set to something true (a switch given, a count above 0), or None."""
    return next((name for name in names if getattr(source, name, False)), None)
