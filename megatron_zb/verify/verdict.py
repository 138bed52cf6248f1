"""The verdict of ``megatron-zb verify``: two runs' losses, grad norms and gradients, compared per iteration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}


def check_tolerance(value: float | None) -> None:
    """``--verify-tolerance`` is a finite, non-negative relative difference (0: bit for bit)."""
    if value is None:
        return
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(
            f"--verify-tolerance {value}: give a finite relative difference of 0 or more (0 asks for identical "
            "losses and grad norms; the defaults are 1e-5 in fp32, 1e-2 with --bf16 or --fp16)"
        )


@dataclass
class Run:
    """What one run measured, merged over the ranks."""

    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, bool] = field(default_factory=dict)
    bubbles: list[float] = field(default_factory=list)
    grads: dict[str, list[float]] = field(default_factory=dict)  # key -> [norm, projection]

    @classmethod
    def from_metrics(cls, rows: list[dict]) -> Run:
        """What Megatron-LM's run logged: one metrics line per iteration (``--metrics-file``)."""
        run = cls()
        for row in rows:
            iteration = row["iteration"]
            if row.get("loss") is not None:
                run.losses[iteration] = row["loss"]
            if row.get("grad_norm") is not None:
                run.grad_norms[iteration] = row["grad_norm"]
            run.skipped[iteration] = bool(row.get("skipped", False))
        return run


@dataclass
class Verdict:
    iterations: list[dict]
    max_loss: float
    max_grad_norm: float
    max_grad: float | None
    parameters: int
    first_difference: int | None
    reason: str
    inconclusive: str | None = None  # why the runs agree without showing anything

    @property
    def passed(self) -> bool:
        return self.first_difference is None and self.inconclusive is None


def relative(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    return abs(value - reference) / max(abs(reference), 1e-30)


def compare(reference: Run, theirs: Run, tolerance: float) -> Verdict:
    """Per-iteration loss and grad-norm differences, then the final per-parameter gradient checksums."""
    iterations, first, reason = [], None, ""
    for iteration in sorted(reference.losses.keys() | reference.grad_norms.keys() | theirs.losses.keys()):
        loss = _difference(reference.losses.get(iteration), theirs.losses.get(iteration))
        norm = _difference(reference.grad_norms.get(iteration), theirs.grad_norms.get(iteration))
        iterations.append({"iteration": iteration, "loss": loss, "grad_norm": norm})
        if first is None and reference.skipped.get(iteration, False) != theirs.skipped.get(iteration, False):
            first, reason = iteration, "one run skipped the optimizer step (inf/nan gradients) and the other did not"
        if first is None and max(loss, norm) > tolerance:
            first = iteration
            over = [(what, value) for what, value in (("loss", loss), ("grad norm", norm)) if value > tolerance]
            reason = " and ".join(f"the {what} differs by {value:.2e} relative" for what, value in over)
    worst_grad, worst_key = None, None
    if reference.grads:
        worst_grad = 0.0
        for key, (norm, projection) in reference.grads.items():
            if key not in theirs.grads:
                worst_grad, worst_key = float("inf"), key
                break
            mine = theirs.grads[key]
            scale = max(norm, 1e-30)
            difference = (
                max(abs(mine[0] - norm), abs(mine[1] - projection)) / scale if mine != [norm, projection] else 0.0
            )
            if difference > worst_grad:
                worst_grad, worst_key = difference, key
        if first is None and worst_grad > tolerance:
            first = max(reference.grad_norms or reference.losses)
            reason = f"the gradient of {worst_key} differs by {worst_grad:.2e} relative"
    if first is None and not iterations:
        first, reason = 0, "neither run logged an iteration"
    inconclusive = None
    if reference.losses and all(reference.skipped.get(i, False) for i in reference.losses):
        inconclusive = (
            "every iteration skipped the optimizer step (inf/nan gradients, e.g. an fp16 loss scale still settling), "
            "so no update was compared; raise --verify-iters"
        )
    return Verdict(
        iterations=iterations,
        max_loss=max((row["loss"] for row in iterations), default=0.0),
        max_grad_norm=max((row["grad_norm"] for row in iterations), default=0.0),
        max_grad=worst_grad,
        parameters=len(reference.grads),
        first_difference=first,
        reason=reason,
        inconclusive=inconclusive,
    )


def _difference(reference: float | None, theirs: float | None) -> float:
    if reference is None and theirs is None:
        return 0.0
    if reference is None or theirs is None:
        return float("inf")
    return relative(theirs, reference)


def report(
    verdict: Verdict,
    reference: Run,
    theirs: Run,
    schedule: str,
    tolerance: float,
    checksums_note: str | None = None,
    replan: str | None = None,
) -> str:
    """The verdict's lines; ``replan``: what the zero-bubble run's re-plan did, added to its last line."""
    lines = [_trained(reference)]
    lines.append(f"{'iteration':>9}  {'loss rel. diff':>14}  {'grad norm rel. diff':>19}")
    lines += [f"{row['iteration']:>9}  {row['loss']:>14.2e}  {row['grad_norm']:>19.2e}" for row in verdict.iterations]
    lines.append(f"max relative loss difference: {verdict.max_loss:.2e}")
    lines.append(f"max relative grad-norm difference: {verdict.max_grad_norm:.2e}")
    if verdict.max_grad is not None:
        lines.append(
            f"max relative gradient difference ({verdict.parameters} parameter checksums, last iteration): "
            f"{verdict.max_grad:.2e}"
        )
    elif checksums_note:
        lines.append(f"per-parameter gradient checksums: not taken ({checksums_note})")
    if theirs.bubbles:
        lines.append(f"measured bubble ({schedule}): {100 * sum(theirs.bubbles) / len(theirs.bubbles):.1f}%")
    if verdict.first_difference is None and verdict.inconclusive:
        lines.append(f"INCONCLUSIVE: {verdict.inconclusive}")
    elif verdict.first_difference is None:
        lines.append(f"OK: {schedule} matches megatron-core's schedule within {tolerance:.0e} relative")
    else:
        lines.append(
            f"MISMATCH at iteration {verdict.first_difference}: {verdict.reason} (tolerance {tolerance:.0e}); "
            f"{schedule} does not train like megatron-core's schedule here"
        )
    if replan:
        lines[-1] += f"; {replan}"
    return "\n".join(lines)


def _trained(reference: Run) -> str:
    """What megatron-core's run did: the first and last loss, and the steps it skipped."""
    if not reference.losses:
        return "megatron-core's run logged no loss"
    first, last = min(reference.losses), max(reference.losses)
    skipped = sum(reference.skipped.get(i, False) for i in reference.losses)
    return (
        f"megatron-core's run: loss {reference.losses[first]:.4f} at iteration {first}, {reference.losses[last]:.4f} "
        f"at {last}; optimizer steps skipped (inf/nan): {skipped} of {len(reference.losses)}"
    )
