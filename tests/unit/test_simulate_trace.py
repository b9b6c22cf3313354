"""One simulated step as lanes (planner.simulate.timeline) and as a Perfetto trace, unfolded."""

from __future__ import annotations

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import with_stage_layers
from planner.simulate.calibration import load_calibration
from planner.simulate.events import LAYER_COMM_KEYS
from planner.simulate.step import simulate_step
from planner.simulate.timeline import LANE_OF, timeline_of
from planner.simulate.trace import trace_json
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError

MODEL = load_model("13B")
CLUSTER = load_cluster("dgx-h100", 16)
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=16)
LAYOUT = with_stage_layers(MODEL, Layout(tp=4, pp=2, dp_replicate=2, micro_batch_size=1, grad_accum_steps=8,
                                         sequence_parallel=True))


def _timeline(layout=LAYOUT, model=MODEL, training=TRAINING, cluster=CLUSTER, **kw):
    result = simulate_step(model, training, layout, cluster, events=True, **kw)
    return result, timeline_of(result, layout)


def test_each_lane_sums_to_the_breakdown_of_the_critical_stage():
    """The lanes are the simulator's own figures: per kind of communication, the bubble and the tail."""
    result, tl = _timeline()
    stage, b = result.critical_stage, result.time_breakdown_s
    assert tl.bubble_s(stage) == pytest.approx(b["bubble"], abs=1e-9)
    for key in LAYER_COMM_KEYS:
        drawn = sum(i.duration_s for i in tl.on(stage) if i.kind == key)
        assert drawn == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
    compute = sum(i.duration_s for i in tl.on(stage, "compute") if i.is_operation)
    assert compute == pytest.approx(b["compute"] + sum(b[k] for k in LAYER_COMM_KEYS), rel=1e-9)
    for key in ("dp_comm", "optimizer", "param_gather", "embedding_sync"):
        assert sum(i.duration_s for i in tl.on(stage) if i.kind == key) == pytest.approx(b[key], abs=1e-12)
    assert b["tp_comm"] > 0 and "TP" in tl.lanes and "PP" in tl.lanes and "DP" in tl.lanes
    assert "CP" not in tl.lanes and "EP" not in tl.lanes  # no lane for what the step does not do
    assert max(i.end_s for i in tl.intervals) == pytest.approx(result.step_time_s)


def test_lanes_under_context_parallelism_and_repriced_stages():
    """CP's exposed ring on its own lane; with calibration solo_speedup (CPU ranks sharing cores) each
    stage's operations are re-priced and their communication with them, still summing to the breakdown."""
    layout = with_stage_layers(MODEL, Layout(tp=2, pp=2, cp=4, micro_batch_size=1, grad_accum_steps=8,
                                             sequence_parallel=True))
    training = TrainingSpec(seq_len=4096, global_batch_size=8)
    cal = load_calibration(None, CLUSTER.gpu).replace(solo_speedup=1.6)
    result = simulate_step(MODEL, training, layout, CLUSTER, cal, engine="torchtitan", events=True)
    plain = simulate_step(MODEL, training, layout, CLUSTER, load_calibration(None, CLUSTER.gpu), engine="torchtitan")
    assert result.step_time_s < plain.step_time_s  # the re-pricing took place
    tl = timeline_of(result, layout)
    assert {"TP", "CP"} <= set(tl.lanes)
    stage, b = result.critical_stage, result.time_breakdown_s
    for key in ("tp_comm", "cp_comm"):
        assert sum(i.duration_s for i in tl.on(stage) if i.kind == key) == pytest.approx(b[key], rel=1e-9)
    assert tl.bubble_s(stage) == pytest.approx(b["bubble"], abs=1e-9)


def test_trace_is_the_timeline_unfolded():
    result, tl = _timeline()
    doc = trace_json(tl)
    threads = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {(stage, lane) for stage in range(2) for lane in tl.lanes}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(tl.intervals)
    compute = [e for e in spans if e["cat"] == "compute" and e["name"][0] in "FB"]
    assert len(compute) == 2 * 2 * 8  # F and B of all 8 micro-batches on 2 stages: nothing folded
    assert {e["args"]["micro_batch"] for e in compute} == set(range(8))
    bubbles = [e for e in spans if e["cat"] == "bubble"]
    for stage in range(2):
        assert sum(e["dur"] for e in bubbles if e["pid"] == stage) == pytest.approx(tl.bubble_s(stage) * 1e6)
    assert {e["cat"] for e in spans} == {*tl.lanes, "bubble"}
    for e in spans:  # every slice on the thread of its lane
        lane = "compute" if e["cat"] == "bubble" else e["cat"]
        assert e["tid"] == tl.lanes.index(lane)
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(result.step_time_s * 1e6)
    assert doc["otherData"]["micro_batches"] == 8


def test_every_kind_has_a_lane():
    assert set(LANE_OF.values()) <= {"compute", "TP", "CP", "EP", "FSDP", "offload", "PP", "DP"}
    assert all(k in LANE_OF for k in LAYER_COMM_KEYS)


def test_timeline_needs_events():
    result = simulate_step(MODEL, TRAINING, LAYOUT, CLUSTER)
    with pytest.raises(UsageError, match="events=True"):
        timeline_of(result, LAYOUT)
