"""Traces of one step: the Chrome/Perfetto JSON and the Gantt chart."""

from __future__ import annotations

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.simulate.step import simulate_step
from planner.simulate.trace import STREAMS, plot_gantt, trace_json
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError

MODEL = load_model("13B")
CLUSTER = load_cluster("dgx-h100", 16)
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=16)
LAYOUT = Layout(tp=4, pp=2, dp_replicate=2, micro_batch_size=1, grad_accum_steps=8, sequence_parallel=True)


def test_trace_has_a_track_per_stage_and_stream():
    result = simulate_step(MODEL, TRAINING, LAYOUT, CLUSTER, events=True)
    doc = trace_json(result, LAYOUT.pp_schedule, LAYOUT.pp, LAYOUT.virtual_stages)
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(stage, stream) for stage in range(2) for stream in STREAMS}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in spans if e["cat"] == "compute" and e["name"][0] in "FB"]
    assert len(compute) == 2 * 2 * 8  # F and B of 8 micro-batches on 2 stages
    assert {e["cat"] for e in spans} == set(STREAMS)  # TP points, PP sends, DP reduction all drawn
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(result.step_time_s * 1e6)


def test_trace_needs_events():
    result = simulate_step(MODEL, TRAINING, LAYOUT, CLUSTER)
    with pytest.raises(UsageError, match="events=True"):
        trace_json(result, LAYOUT.pp_schedule, LAYOUT.pp, LAYOUT.virtual_stages)


def test_gantt_png_is_written(tmp_path):
    layout = Layout(tp=4, pp=2, dp_replicate=2, micro_batch_size=1, grad_accum_steps=8, pp_schedule="zb-v",
                    virtual_stages=2)
    result = simulate_step(MODEL, TRAINING, layout, CLUSTER, events=True)
    path = tmp_path / "step.png"
    plot_gantt(result, layout.pp_schedule, layout.pp, layout.virtual_stages, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
