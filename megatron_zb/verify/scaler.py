"""The scaled copy's bookkeeping: a parsed command line rewritten flag by flag, each change with its reason.

``Scaler`` gives a flag new values or drops it and records why; ``ScaledLine`` is the result (both
argvs, the table verify prints). What to change is ``scale.py``'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..flags.megatron_lm_parser import Given

# A flag the scaled copy sets -> the flags that need it otherwise, dropped with it (dest, why)
DEPENDENTS = {
    "--no-gradient-accumulation-fusion": (
        ("defer_embedding_wgrad_compute", "defers the embedding's weight gradient into the fused gradient-"
         "accumulation kernel, which a CPU run turns off"),
    ),
    "--no-overlap-p2p-communication": (
        ("overlap_p2p_comm_warmup_flush", "overlaps warm-up and flush P2P, which needs the overlapped P2P that the "
         "scaled copy turns off"),
    ),
    "--mock-data": (
        ("fim_data", "fill-in-the-middle samples are cut from real documents; mock data has none"),
        ("fim_rate", "no fill-in-the-middle samples with mock data"),
        ("fim_spm_rate", "no fill-in-the-middle samples with mock data"),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Change:
    flag: str
    given: str
    scaled: str
    why: str


@dataclass
class ScaledLine:
    argv: list[str]
    reference_argv: list[str]
    processes: int
    schedule: str
    precision: str
    changes: list[Change] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def table(self) -> str:
        """Every changed flag with its reason, then the flags kept as given."""
        rows = [("flag", "your line", "scaled copy", "why")]
        rows += [(c.flag, c.given, c.scaled, c.why) for c in self.changes]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
                 for row in rows]  # fmt: skip
        lines.insert(1, "  ".join("-" * width for width in widths) + "  ---")
        kept = ", ".join(self.kept) if self.kept else "none"
        lines.append(f"kept as given ({len(self.kept)}): {kept}")
        return "\n".join(lines)


class Refused(ValueError):
    """A flag verify cannot check, named with what would work."""


class Scaler:
    """Rewrites a parsed command line flag by flag, recording each change and its reason."""

    def __init__(self, parser: argparse.ArgumentParser, flags: Sequence[Given], args: argparse.Namespace):
        self.parser, self.args = parser, args
        self.flags: list[Given | None] = list(flags)
        self.touched: set[int] = set()
        self.added: list[Given] = []
        self.changes: list[Change] = []

    # -- reading
    def given(self, dest: str) -> list[int]:
        return [i for i, given in enumerate(self.flags) if given is not None and given.dest == dest]

    def has(self, dest: str) -> bool:
        return bool(self.given(dest))

    def knows(self, option: str) -> bool:
        return option in self.parser._option_string_actions

    def value(self, dest: str):
        return getattr(self.args, dest, None)

    # -- writing
    def set(self, option: str, values: Sequence[str] | None, why: str) -> None:
        """Give ``option`` these values (None: a switch), replacing what the line gave for its destination."""
        action = self.parser._option_string_actions.get(option)
        if action is None:
            return  # this Megatron-LM has no such flag: nothing to set
        new = Given(option, tuple(values or ()), action)
        indices = self.given(action.dest)
        if indices:
            old = self.flags[indices[0]]
            if old.tokens == new.tokens:
                return  # the line already says it: kept as given
            self.flags[indices[0]] = new
            for index in indices[1:]:
                self.flags[index] = None
            self.touched.add(indices[0])
            self.changes.append(Change(old.flag, " ".join(old.values) or "given", " ".join(new.values) or "given", why))
        else:
            default = getattr(action.default, "name", action.default)
            shown = "(not given)" if action.nargs == 0 or default is None else f"(default {default})"
            self.added.append(new)
            self.changes.append(Change(option, shown, " ".join(new.values) or "given", why))
        for dest, reason in DEPENDENTS.get(option, ()):
            self.drop(dest, f"{reason} ({option}: {why})")

    def drop(self, dest: str, why: str) -> None:
        for index in self.given(dest):
            old = self.flags[index]
            self.flags[index] = None
            self.changes.append(Change(old.flag, " ".join(old.values) or "given", "not used", why))

    def note(self, dest: str, why: str) -> None:
        """Keep the line's ``dest`` as given, listed with ``why`` (it means something else in the scaled runs)."""
        for index in self.given(dest):
            old = self.flags[index]
            self.touched.add(index)
            shown = " ".join(old.values) or "given"
            self.changes.append(Change(old.flag, shown, shown, why))

    def result(self) -> tuple[list[Given], list[str]]:
        kept = [str(given) for index, given in enumerate(self.flags) if given is not None and index not in self.touched]
        return [given for given in self.flags if given is not None] + self.added, kept


@dataclass(frozen=True)
class Limits:
    iterations: int
    data_parallel: int
    folder: Path  # verify's temporary folder: caches, checkpoints, costs
