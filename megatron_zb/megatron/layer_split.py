"""How many decoder layers each layer block gets (pure Python: the flag checks run before torch loads)."""

from __future__ import annotations

from ..schedule.placement import Placement


def layers_per_block(
    num_layers: int, placement: Placement, pad: bool = False, first: int | None = None, last: int | None = None
) -> list[int]:
    """Decoder layers of each block, in layer order.

    ``first``/``last`` (``--decoder-first/last-pipeline-num-layers`` on a placement megatron does not build
    itself, the V) are the first and the last block's counts; the blocks between split the rest evenly.

    Without ``pad`` every block gets ``num_layers / blocks``. With ``pad``
    (``--allow-padding-num-layers``) the embedding block (0) and the loss block (last) count
    their extra work as one layer each: they get one layer fewer when ``num_layers + 2``
    divides by the number of blocks (keeping at least one layer each); an even split is
    still used when it fits.
    """
    blocks = placement.num_stages
    if num_layers < 1:
        raise ValueError(f"--num-layers must be at least 1, got {num_layers}")
    if first is not None or last is not None:
        return _with_ends(num_layers, placement, first, last)
    if num_layers % blocks == 0:
        return [num_layers // blocks] * blocks
    if pad and (num_layers + 2) % blocks == 0 and num_layers + 2 >= 2 * blocks:
        per_block = (num_layers + 2) // blocks
        return [per_block - (block == 0) - (block == blocks - 1) for block in range(blocks)]
    raise ValueError(_refusal(num_layers, placement, pad))


def _with_ends(num_layers: int, placement: Placement, first: int | None, last: int | None) -> list[int]:
    """The first and last block's counts as given, the blocks between each the same share of the rest."""
    blocks = placement.num_stages
    middle = blocks - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    per, left = divmod(rest, middle) if middle else (0, rest)
    if min(first or 1, last or 1) < 1 or rest < 0 or left or (middle and per < 1):
        given = ", ".join(
            f"--decoder-{end}-pipeline-num-layers {count}" for end, count in (("first", first), ("last", last)) if count
        )
        raise ValueError(
            f"{given} leave {rest} of --num-layers {num_layers} to the {middle} other layer blocks of {blocks} "
            f"({placement.kind} placement, pipeline size {placement.pp} x {placement.chunks} chunk(s) per rank), "
            "which must split them evenly, at least one layer each"
        )
    counts = [per] * blocks
    counts[0] = counts[0] if first is None else first
    counts[-1] = counts[-1] if last is None else last
    return counts


def _refusal(num_layers: int, placement: Placement, pad: bool) -> str:
    blocks = placement.num_stages
    where = (
        f"{blocks} layer blocks (pipeline size {placement.pp} x {placement.chunks} chunk(s) per rank, "
        f"{placement.kind} placement)"
    )
    even = _nearest(num_layers, blocks, 0, minimum=blocks)
    text = f"--num-layers {num_layers} does not split evenly into {where}; use --num-layers {even}"
    if not placement.megatron_builds:  # our layout: each pipeline stage's layers split into its chunks
        per_stage = f"a multiple of {placement.chunks} layers per pipeline stage"
        needs = f" (the {placement.kind} placement needs {per_stage}); use"
        text = text.replace("; use", needs, 1)
    padded = _nearest(num_layers, blocks, 2, minimum=2 * blocks - 2)
    pad_fits = (num_layers + 2) % blocks == 0 and num_layers + 2 >= 2 * blocks
    if pad:
        return (
            f"{text}, or, as --allow-padding-num-layers is on (embedding and loss blocks take one layer fewer, "
            f"so num_layers + 2 must divide by {blocks}, at least one layer each), --num-layers {padded}"
        )
    if not placement.megatron_builds or pad_fits:
        fits = "which fits this count" if pad_fits else f"which fits --num-layers {padded}"
        text += f", or pass --allow-padding-num-layers (embedding and loss blocks take one layer fewer, {fits})"
    return text


def _nearest(num_layers: int, blocks: int, extra: int, minimum: int) -> str:
    """The counts just below and above ``num_layers`` with ``count + extra`` divisible by ``blocks``."""
    below = (num_layers + extra) // blocks * blocks - extra
    found = [count for count in (below, below + blocks) if count >= minimum and count != num_layers]
    return " or ".join(str(count) for count in found or [max(minimum, below + blocks)])
