"""What the training log reports from measured passes: bubble rate, a Perfetto trace, metrics lines.

``PassProfiler`` records each compute pass's ``perf_counter`` start and end (time spent waiting
for its inputs excluded). The bubble of one ``forward_backward`` call on one rank is the part
of its wall time in which no pass ran; the pipeline's is the mean (and the worst) over its
ranks. The trace puts one iteration's passes of every pipeline rank on one time axis, named
as in the simulated trace, so the two open side by side in ui.perfetto.dev.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..render.chrome_trace import metadata_events, pass_event
from ..runtime.profiler import PassRecord
from ..schedule.simulate import PassTime

SECONDS_TO_US = 1e6


def measured_bubble(records: list[PassRecord], iteration: int, wall_start: float, wall_end: float) -> float:
    """1 - (sum of this rank's pass durations in ``iteration``) / (wall time of its forward_backward call).

    ``wall_start``/``wall_end`` are ``perf_counter`` readings around the call (on a GPU, taken
    after a device synchronize, as the profiler's own times are).
    """
    wall = wall_end - wall_start
    if wall <= 0:
        raise ValueError(
            f"wall_end ({wall_end}) must be after wall_start ({wall_start}): time the forward_backward call"
        )
    busy = sum(r.end - r.start for r in records if r.iteration == iteration)
    return 1.0 - busy / wall


@dataclass(frozen=True)
class PipelineBubble:
    mean: float  # what the log reports: comparable to the simulator's bubble rate
    max: float  # the worst rank
    per_rank: tuple[float, ...]  # in pipeline rank order


def pipeline_bubble(
    records: list[PassRecord],
    iteration: int,
    wall_start: float,
    wall_end: float,
    group: dist.ProcessGroup | None = None,
) -> PipelineBubble:
    """Every pipeline rank's ``measured_bubble``, the same on all of them (one all-gather over ``group``).

    Collective over ``group``, megatron-core's pipeline group when None.
    """
    local = measured_bubble(records, iteration, wall_start, wall_end)
    if not dist.is_initialized():
        return PipelineBubble(local, local, (local,))
    group = _pipeline_group() if group is None else group
    device = _device(group)
    mine = torch.tensor([local], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    per_rank = tuple(float(t.item()) for t in gathered)
    return PipelineBubble(sum(per_rank) / len(per_rank), max(per_rank), per_rank)


def gather_records(
    records: list[PassRecord], iteration: int, group: dist.ProcessGroup | None = None
) -> list[list[PassRecord]] | None:
    """This iteration's records of every rank of ``group``, on its first rank (None elsewhere).

    Collective over ``group`` (megatron-core's pipeline group when None; the first pipeline's
    first rank is global rank 0). Each rank's times are made relative to its exit from a
    barrier taken here, which all ranks leave together (to within the barrier's latency): that
    aligns ranks whose clocks differ, e.g. on several nodes. Only relative times matter to
    ``write_measured_trace``.
    """
    group = _pipeline_group() if group is None else group
    mine = [r for r in records if r.iteration == iteration]
    dist.barrier(group=group)
    reference = time.perf_counter()
    shifted = [replace(r, start=r.start - reference, end=r.end - reference) for r in mine]
    gathered: list | None = [None] * group.size() if group.rank() == 0 else None
    dist.gather_object(shifted, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return gathered


def write_measured_trace(
    path: str | Path,
    records_per_rank: list[list[PassRecord]],
    schedule_name: str,
    iteration: int | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    """Write a Chrome/Perfetto trace of one iteration's measured passes; returns the trace object.

    ``records_per_rank[r]`` are pipeline rank r's records (``gather_records`` output, or raw
    ``perf_counter`` times from one machine). ``iteration`` picks one iteration when the records
    hold several. Times start at the earliest pass of any rank; one track per pipeline rank.
    ``extra`` (wall times, loss, ...) goes into the trace's ``otherData``.
    """
    chosen = [[r for r in rank if iteration is None or r.iteration == iteration] for rank in records_per_rank]
    iterations = sorted({r.iteration for rank in chosen for r in rank})
    if len(iterations) != 1:
        found = ", ".join(map(str, iterations)) or "none"
        raise ValueError(f"a measured trace shows one iteration; records hold iteration(s) {found}: pass iteration=")
    start = min(r.start for rank in chosen for r in rank)
    ranks = [
        [PassTime(r.pass_, index, r.chunk, r.start - start, r.end - start) for r in sorted(rank, key=lambda r: r.start)]
        for index, rank in enumerate(chosen)
    ]
    name = f"{schedule_name} measured iteration {iterations[0]}"
    header = metadata_events(name, len(ranks))
    trace = {
        "traceEvents": header + [pass_event(t, SECONDS_TO_US) for rank in ranks for t in rank],
        "displayTimeUnit": "ms",
        "otherData": {**_summary(ranks), "schedule": schedule_name, "iteration": iterations[0], **(extra or {})},
    }
    Path(path).write_text(json.dumps(trace))
    return trace


def _summary(ranks: list[list[PassTime]]) -> dict[str, Any]:
    """Busy time per rank and the bubble over the traced span, in seconds (the simulator's definitions)."""
    busy = [sum(t.end - t.start for t in rank) for rank in ranks]
    makespan = max((t.end for rank in ranks for t in rank), default=0.0)
    capacity = makespan * len(ranks)
    return {
        "pp": len(ranks),
        "measured": True,
        "time_unit_us": SECONDS_TO_US,
        "makespan_s": makespan,
        "busy_s": busy,
        "bubble_rate_makespan": (capacity - sum(busy)) / capacity if capacity else 0.0,
    }


class MetricsWriter:
    """Appends one JSON line per iteration to ``path``, flushed at once (scripts tail the file).

    Only the logging rank writes: ``enabled`` defaults to the last global rank (Megatron-LM's
    ``print_rank_last``), or True without torch.distributed. Non-finite numbers (a NaN loss)
    are written as null so every line stays strict JSON.
    """

    def __init__(self, path: str | Path, enabled: bool | None = None):
        self.path = Path(path)
        if enabled is None:
            enabled = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        self.enabled = enabled
        self._file = None

    def write(
        self, iteration: int, loss, iteration_time_s: float, bubble_rate: float | None, schedule: str, **extra
    ) -> dict | None:
        """Append one line; returns the record written (None on ranks that do not log)."""
        if not self.enabled:
            return None
        fixed = {
            "iteration": int(iteration),
            "loss": loss,
            "iteration_time_s": iteration_time_s,
            "bubble_rate": bubble_rate,
            "schedule": schedule,
        }
        record = _plain({**fixed, **extra})
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The records a MetricsWriter appended, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _plain(value):
    """JSON-ready: tensors and numpy scalars to Python numbers, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.item() if value.numel() == 1 else value.tolist())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _pipeline_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
