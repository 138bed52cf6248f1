"""Data iterators that can give an iteration's microbatches again.

When a speculative optimizer step turns out wrong, the forwards that ran on its parameters are
redone. They must see the same microbatches, and Megatron's iterators cannot rewind (nor
should they be read twice: the next iteration would then skip data). ``Replay`` remembers what
was read during one ``forward_backward`` call.
"""

from __future__ import annotations

from collections.abc import Iterator


class Replay:
    def __init__(self, source: Iterator):
        self.source = source
        self.seen: list = []
        self.position = 0

    def __iter__(self) -> Replay:
        return self

    def __next__(self):
        if self.position < len(self.seen):
            item = self.seen[self.position]
        else:
            item = next(self.source)
            self.seen.append(item)
        self.position += 1
        return item

    def rewind(self) -> None:
        """Give the items read so far again, from the first."""
        self.position = 0

    def __getattr__(self, name: str):
        return getattr(self.source, name)  # e.g. Megatron's RerunDataIterator attributes
