"""Multi-process part of test_calibrate.py: real torchrun ranks on gloo."""

from __future__ import annotations

import json
import math

from terminal_run import run_on_terminal

from planner.simulate.calibration import CalibrationProfile, load_calibration
from topologies.cluster_load import load_cluster
from topologies.hardware import get_gpu


def test_calibrate_tiny_grid_writes_a_profile_simulate_accepts(cli, tmp_path):
    """On a terminal: a bar for the kernels, then for the collectives; the profile is what simulate takes."""
    out = tmp_path / "profile.json"
    r = run_on_terminal("calibrate", "--device", "cpu", "--grid", "tiny", "--max-ranks", "2", "--out", str(out),
                        timeout=300)
    assert r.code == 0, r.stderr
    assert "\x1b[?25l" in r.stderr and "cpu: kernels" in r.stderr and "collectives over 2..2 ranks" in r.stderr
    data = json.loads(out.read_text())
    profile = CalibrationProfile.from_json(data)  # validates every field's range
    assert profile.gpu == "cpu" and "calibrate" in profile.source
    assert profile.link_efficiency.get("shm") is not None  # the 2-rank gloo collectives were fitted
    assert all(math.isfinite(v) for v in (profile.gemm_efficiency, profile.gemm_knee, profile.latency_scale))
    samples = json.loads(out.with_suffix(".samples.json").read_text())
    assert len(samples["gemm"]) == 3 and {s["op"] for s in samples["comm"]} == {
        "all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert load_calibration(out, get_gpu("cpu")) == profile
    plan_path = tmp_path / "plan.json"
    _cpu_plan().save(plan_path)
    sim = cli("simulate", str(plan_path), "--calibration", str(out), "--json")
    assert sim.code == 0, sim.stderr
    assert sim.json()["step_time_s"] > 0


def _cpu_plan():
    from planner.layout import Layout
    from planner.model.load import load_model
    from planner.plan import Plan, with_stage_layers
    from planner.training import TrainingSpec

    model = load_model("debug")
    return Plan(model=model, cluster=load_cluster("cpu", 2),
                training=TrainingSpec(seq_len=64, global_batch_size=4, dtype="fp32"),
                layout=with_stage_layers(model, Layout(dp_shard=2, zero_stage=3, micro_batch_size=2)))


def test_calibrate_with_a_model_measures_its_shapes_and_blocks(cli, tmp_path):
    """--model adds the plan's GEMMs and times one executor block plain, alone, under TP and FSDP on 2 gloo ranks."""
    out = tmp_path / "profile.json"
    r = run_on_terminal("calibrate", "--device", "cpu", "--grid", "tiny", "--max-ranks", "2", "--model", "debug",
                        "--seq-len", "64", "--micro-batch", "2", "--out", str(out), "--json", timeout=600)
    assert r.code == 0, r.stderr
    assert "\x1b[?25l" not in r.stderr and "kernels" not in r.stderr  # --json: no bar, even on a terminal
    assert json.loads(r.stdout)["gpu"] == "cpu"
    profile = CalibrationProfile.from_json(json.loads(out.read_text()))
    samples = json.loads(out.with_suffix(".samples.json").read_text())
    assert {(g["m"], g["n"], g["k"]) for g in samples["gemm"]} >= {(128, 64 + 2 * 32, 64), (128, 256, 64)}
    blocks = samples["blocks"]
    assert blocks["world"] == 2 and all(blocks[k] > 0 for k in ("plain", "plain_solo", "tp", "fsdp"))
    # the debug model's TP block: every split linear runs its forward and backward operators on DTensors
    assert blocks["tp_ops"][1] > blocks["tp_ops"][0] > 0
    assert (profile.dtensor_ops_forward, profile.dtensor_ops_backward) == tuple(blocks["tp_ops"])
    assert profile.solo_speedup >= 1.0 and profile.dtensor_op_overhead_s >= 0.0
    assert samples["sharing_ranks"] == 2 and profile.comm_overlap in (0.0, 1.0)
    assert set(profile.collective_scale) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
