"""`meshplan simulate` as a user runs it: a subprocess on a plan.json written here."""

from __future__ import annotations

import json

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster


@pytest.fixture
def plan_path(tmp_path):
    model = load_model("13B")
    layout = with_stage_layers(model, Layout(tp=4, pp=2, dp_replicate=2, micro_batch_size=1, grad_accum_steps=8,
                                             recompute="selective", sequence_parallel=True))
    plan = Plan(model, load_cluster("dgx-h100", 16), TrainingSpec(seq_len=4096, global_batch_size=16), layout)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_json_prediction(cli, plan_path):
    res = cli("simulate", str(plan_path), "--json")
    assert res.code == 0, res.stderr
    pred = doc = res.json()
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes",
                "memory_breakdown_bytes", "time_breakdown_s"):  # plan.json's prediction keys
        assert key in doc
    assert pred["step_time_s"] > 0 and 0 < pred["mfu"] < 1
    b = pred["time_breakdown_s"]
    assert b["compute"] + b["exposed_comm"] + b["bubble"] + b["optimizer"] == pytest.approx(pred["step_time_s"])
    assert doc["plan_prediction"] is None  # the plan was written without one


def test_trace_and_png(cli, plan_path, tmp_path):
    trace, png = tmp_path / "step.json", tmp_path / "step.png"
    res = cli("simulate", str(plan_path), "--trace", str(trace), "--png", str(png))
    assert res.code == 0, res.stderr
    assert "where the step goes" in res.stdout and "compute" in res.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"compute", "TP", "PP", "DP"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_missing_plan_is_a_usage_error(cli, tmp_path):
    res = cli("simulate", str(tmp_path / "nope.json"))
    assert res.code == 2
    assert "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_calibration_for_another_gpu_is_refused(cli, plan_path, tmp_path):
    from planner.simulate.calibration import CalibrationProfile

    cal = tmp_path / "cal.json"
    CalibrationProfile(gpu="a100-80g-sxm").save(cal)
    res = cli("simulate", str(plan_path), "--calibration", str(cal))
    assert res.code == 2
    assert "a100-80g-sxm" in res.stderr and "Traceback" not in res.stderr
