"""One simulated step as a timeline: Chrome/Perfetto trace JSON and a Gantt chart PNG.

Tracks: one process per pipeline stage, one thread per stream in it:
  compute  every F/B/W operation (its whole duration) and the optimizer step
  TP       the exposed layer communication inside each operation (TP points,
           CP ring, EP all-to-all, FSDP gathers), drawn at the operation's end
  PP       activation (after F) and gradient (after B) transfers to the next stage
  DP       gradient reduction, tied-embedding sync and parameter all-gather after
           the pipeline
Open the JSON at https://ui.perfetto.dev or chrome://tracing. Times are microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.charts import save_figure
from planner.simulate.pipeline import KIND_NAMES, B, F, W, chunk_owner
from planner.simulate.step import StepEvents, StepResult
from topologies.errors import UsageError

STREAMS = ("compute", "TP", "PP", "DP")
_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8C8C3C", "comm": "#DD8452", "PP": "#937860",
           "dp_comm": "#C44E52", "embedding_sync": "#DA8BC3", "param_gather": "#C44E52", "optimizer": "#8172B3"}


def _segments(events: StepEvents, schedule: str, pp: int, v: int) -> list[tuple[int, str, str, float, float, dict]]:
    """(stage, stream, name, start_s, end_s, args) for every drawn interval."""
    owner = chunk_owner(schedule, pp, v)
    n_chunks = pp * v
    out = []
    for op in events.ops:
        kind = KIND_NAMES[op.kind]
        args = {"chunk": op.chunk, "micro_batch": op.micro_batch}
        out.append((op.rank, "compute", f"{kind}{op.chunk} mb{op.micro_batch}", op.start_s, op.end_s, args))
        comm = events.op_comm_s.get((op.kind, op.chunk), 0.0)
        if comm > 0 and op.kind != W:
            out.append((op.rank, "TP", f"{kind} comm", op.end_s - comm, op.end_s, args))
        nxt = op.chunk + 1 if op.kind == F else op.chunk - 1
        if op.kind in (F, B) and 0 <= nxt < n_chunks and owner[nxt] != op.rank:
            lag = events.p2p_s[min(op.chunk, nxt)]
            label = "send activations" if op.kind == F else "send gradients"
            out.append((op.rank, "PP", label, op.end_s, op.end_s + lag, args))
    for rank, tail in enumerate(events.tails):
        for name, start, end in tail:
            out.append((rank, "compute" if name == "optimizer" else "DP", name, start, end, {}))
    return out


def trace_json(result: StepResult, schedule: str, pp: int, virtual_stages: int) -> dict[str, Any]:
    """The Chrome trace-event document of one simulated step (needs simulate_step(events=True))."""
    if result.events is None:
        raise UsageError("the step was simulated without events: call simulate_step(..., events=True)")
    trace: list[dict[str, Any]] = []
    for stage in range(pp):
        trace.append({"ph": "M", "name": "process_name", "pid": stage, "args": {"name": f"stage {stage}"}})
        for tid, stream in enumerate(STREAMS):
            trace.append({"ph": "M", "name": "thread_name", "pid": stage, "tid": tid, "args": {"name": stream}})
    for stage, stream, name, start, end, args in _segments(result.events, schedule, pp, virtual_stages):
        trace.append({"ph": "X", "name": name, "cat": stream, "pid": stage, "tid": STREAMS.index(stream),
                      "ts": start * 1e6, "dur": (end - start) * 1e6, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": result.step_time_s, "time_breakdown_s": result.time_breakdown_s}}


def write_trace(result: StepResult, schedule: str, pp: int, virtual_stages: int, path: str | Path) -> None:
    from topologies.files import write_text

    write_text(path, json.dumps(trace_json(result, schedule, pp, virtual_stages)), what="trace")


def plot_gantt(result: StepResult, schedule: str, pp: int, virtual_stages: int, path: str | Path,
               title: str = "") -> None:
    """A Gantt chart of the step: per stage a compute row with thinner TP/PP/DP rows beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if result.events is None:
        raise UsageError("the step was simulated without events: call simulate_step(..., events=True)")
    bars: dict[tuple[float, float, str], list[tuple[float, float]]] = {}
    rows = {"compute": (0.0, 0.9), "TP": (0.92, 0.25), "PP": (1.19, 0.25), "DP": (1.46, 0.25)}
    pitch = 1.9
    for stage, stream, name, start, end, _ in _segments(result.events, schedule, pp, virtual_stages):
        offset, height = rows[stream]
        color = _color(stream, name)
        bars.setdefault((stage * pitch + offset, height, color), []).append((start, end - start))
    fig, ax = plt.subplots(figsize=(12, 2.0 + 1.0 * pp))
    for (y, height, color), spans in bars.items():
        ax.broken_barh(spans, (y, height), facecolors=color, edgecolor="white", linewidth=0.2)
    # every row labelled: the stage's compute row, then its communication tracks beneath it
    track_names = {"compute": "stage {s} compute", "TP": "TP/CP/EP/FSDP", "PP": "PP send/recv", "DP": "DP reduce"}
    ticks = [(s * pitch + off + h / 2, name.format(s=s)) for s in range(pp)
             for (off, h), name in zip(rows.values(), track_names.values(), strict=True)]
    ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=7)
    for tick, (_, label) in zip(ax.get_yticklabels(), ticks, strict=True):
        if "compute" in label:
            tick.set_fontweight("bold")
    ax.set_ylim(pitch * pp, -0.1)
    ax.set_xlim(0, result.step_time_s)
    ax.set_xlabel("time in step (s)")
    b = result.time_breakdown_s
    detail = (f"one step: {result.step_time_s:.3f} s, bubble {b['bubble']:.3f} s, "
              f"exposed comm {b['exposed_comm']:.3f} s, MFU {100 * result.mfu:.1f}%")
    ax.set_title(f"{title}\n{detail}" if title else detail, fontsize=10)
    legend = [Patch(color=_COLORS[k], label=label) for k, label in
              (("F", "forward"), ("B", "backward"), ("W", "weight grad"), ("comm", "TP/CP/EP/FSDP comm"),
               ("PP", "PP send"), ("dp_comm", "DP reduce / gather"), ("optimizer", "optimizer"))]
    fig.legend(handles=legend, loc="lower center", ncol=7, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (2.0 + 1.0 * pp), 1, 1))  # keep the legend's strip free
    save_figure(fig, path)


def _color(stream: str, name: str) -> str:
    if stream == "compute":
        return _COLORS.get(name, _COLORS.get(name[0], _COLORS["F"]))
    if stream == "TP":
        return _COLORS["comm"]
    if stream == "PP":
        return _COLORS["PP"]
    return _COLORS.get(name, _COLORS["dp_comm"])
