"""One simulated step as a Chrome/Perfetto trace (JSON), unfolded: every operation of every micro-batch.

One process per pipeline stage, one thread per lane of `planner.simulate.timeline`
(compute, then each kind of exposed communication: TP, CP, EP, FSDP, offload, PP,
DP); the stage's idle time inside the pipeline is on its compute thread as
`bubble` slices. The step chart (`planner.charts.timeline`) shows the same
intervals with the steady state folded. Open the JSON at https://ui.perfetto.dev
or chrome://tracing. Times are microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.simulate.timeline import Interval, Timeline

COMM_NAMES = {"tp_comm": "TP comm", "cp_comm": "CP comm", "ep_comm": "EP all-to-all", "fsdp_comm": "FSDP gather",
              "offload_comm": "host link copies", "dp_comm": "DP reduce", "embedding_sync": "embedding sync",
              "param_gather": "parameter gather"}


def slice_name(interval: Interval) -> str:
    if interval.is_operation:
        return f"{interval.kind}{interval.chunk} mb{interval.micro_batch}"
    return COMM_NAMES.get(interval.kind, interval.kind)


def trace_json(timeline: Timeline) -> dict[str, Any]:
    """The Chrome trace-event document of one simulated step."""
    lanes = timeline.lanes
    trace: list[dict[str, Any]] = []
    for stage in range(timeline.pp):
        trace.append({"ph": "M", "name": "process_name", "pid": stage, "args": {"name": f"stage {stage}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": stage, "args": {"sort_index": stage}})
        for tid, lane in enumerate(lanes):
            trace.append({"ph": "M", "name": "thread_name", "pid": stage, "tid": tid, "args": {"name": lane}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": stage, "tid": tid,
                          "args": {"sort_index": tid}})
    for i in timeline.intervals:
        args = {k: v for k, v in (("chunk", i.chunk), ("micro_batch", i.micro_batch)) if v is not None}
        trace.append({"ph": "X", "name": slice_name(i), "cat": "bubble" if i.kind == "bubble" else i.lane,
                      "pid": i.stage, "tid": lanes.index(i.lane), "ts": i.start_s * 1e6,
                      "dur": i.duration_s * 1e6, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": timeline.step_time_s, "time_breakdown_s": timeline.time_breakdown_s,
                          "schedule": timeline.schedule, "virtual_stages": timeline.virtual_stages,
                          "micro_batches": timeline.micro_batches, "critical_stage": timeline.critical_stage}}


def write_trace(timeline: Timeline, path: str | Path) -> None:
    from topologies.files import write_text

    write_text(path, json.dumps(trace_json(timeline)), what="trace")
