"""Chrome / Perfetto trace of a simulated timeline (open in ui.perfetto.dev or chrome://tracing).

One process, one thread per rank, one complete event per pass at its simulated time, and a
counter track per rank of activation memory. Data-parallel collectives of a rank go on a thread
of their own (``COLLECTIVES_TID + rank``), releases of gathered weights are instant events; an
all-to-all split out of a pass holds the compute stream and goes on the rank's thread, before its pass.
Trace times are microseconds, so simulated time is multiplied by ``time_unit_us`` (the default
reads one simulated unit as one millisecond).
"""

from __future__ import annotations

import json
from typing import Any

from ..schedule.actions import Stream, spec
from ..schedule.simulate import PassTime, Timeline

PID = 0
COLLECTIVES_TID = 1000  # + rank: the track of a rank's data-parallel collectives


def metadata_events(name: str, num_ranks: int) -> list[dict[str, Any]]:
    """The trace's title and one named track per rank (shared with the measured-pass trace)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": f"megatron-zb {name}"}}
    ]
    for rank in range(num_ranks):
        events.append({"ph": "M", "pid": PID, "tid": rank, "name": "thread_name", "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "pid": PID, "tid": rank, "name": "thread_sort_index", "args": {"sort_index": rank}})
    return events


def collective_track(rank: int) -> list[dict[str, Any]]:
    """The named track of a rank's data-parallel collectives, sorted under the rank's own."""
    tid = COLLECTIVES_TID + rank
    return [
        {"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": f"rank {rank} collectives"}},
        {"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": rank + 0.5}},
    ]


def pass_event(t: PassTime, unit: float) -> dict[str, Any]:
    """One pass as a complete event; ``unit`` converts its times to microseconds."""
    p = t.pass_
    stream = spec(p.kind).stream
    if not spec(p.kind).blocks_compute:
        event = {
            "ph": "i" if stream is Stream.HOST else "X",
            "pid": PID,
            "tid": t.rank if stream is Stream.HOST else COLLECTIVES_TID + t.rank,
            "name": str(p),
            "cat": p.kind.value,
            "ts": t.start * unit,
            "args": {"stage": p.stage, "chunk": t.chunk, "occurrence": p.microbatch, "pipe": p.pipe},
        }
        if stream is Stream.HOST:
            event["s"] = "t"
        else:
            event["dur"] = (t.end - t.start) * unit
        return event
    return {
        "ph": "X",
        "pid": PID,
        "tid": t.rank,
        "name": f"{p.kind.value} mb{p.microbatch}",
        "cat": p.kind.value,
        "ts": t.start * unit,
        "dur": (t.end - t.start) * unit,
        "args": {"stage": p.stage, "chunk": t.chunk, "microbatch": p.microbatch, "pipe": p.pipe},
    }


def _memory(timeline: Timeline, unit: float) -> list[dict[str, Any]]:
    """Level after each pass, stamped at the pass's end; a zero before a rank's first pass."""
    events = []
    for rank, (passes, levels) in enumerate(zip(timeline.ranks, timeline.memory, strict=True)):
        name = f"activation memory rank {rank}"
        if passes:
            events.append({"ph": "C", "pid": PID, "name": name, "ts": passes[0].start * unit, "args": {"memory": 0.0}})
        for t, level in zip(passes, levels, strict=True):
            events.append({"ph": "C", "pid": PID, "name": name, "ts": t.end * unit, "args": {"memory": level}})
    return events


def render_chrome_trace(timeline: Timeline, time_unit_us: float = 1000.0) -> dict[str, Any]:
    """The trace event JSON object; ``json.dumps`` it to get a loadable file."""
    s = timeline.schedule
    passes = [pass_event(t, time_unit_us) for rank in timeline.ranks for t in rank]
    tracks = [
        event
        for rank, ranked in enumerate(timeline.ranks)
        if any(spec(t.pass_.kind).stream is Stream.COLLECTIVE for t in ranked)
        for event in collective_track(rank)
    ]
    return {
        "traceEvents": metadata_events(timeline.schedule.name, len(timeline.ranks))
        + tracks
        + passes
        + _memory(timeline, time_unit_us),
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": s.name,
            "pp": s.pp,
            "microbatches": s.microbatches,
            "chunks": s.chunks,
            "time_unit_us": time_unit_us,
            "makespan": timeline.makespan,
            "stage_span": timeline.stage_span,
            "bubble_rate": timeline.bubble_rate,
            "bubble_rate_makespan": timeline.bubble_rate_makespan,
            "peak_memory": list(timeline.peak_memory),
        },
    }


def render_chrome_trace_json(timeline: Timeline) -> str:
    """The trace as one line of JSON, for ``FORMATS`` and the CLI."""
    return json.dumps(render_chrome_trace(timeline))
