"""Calibration profiles: defaults per GPU, JSON round trip, refusals with reasons."""

from __future__ import annotations

import json

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.simulate.calibration import (
    CALIBRATION_DIR,
    CalibrationProfile,
    default_calibration,
    load_calibration,
)
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError
from topologies.hardware import get_gpu


def test_round_trip_through_json(tmp_path):
    profile = CalibrationProfile(gpu="h100-sxm", gemm_efficiency=0.7, link_efficiency={"net": 0.8},
                                 other_bytes=2 << 30, source="test", date="2024-01-01")
    path = tmp_path / "p.json"
    profile.save(path)
    assert CalibrationProfile.from_json(json.loads(path.read_text())) == profile
    assert load_calibration(path, get_gpu("h100-sxm")) == profile


def test_shipped_a100_profile_is_the_a100_default():
    assert (CALIBRATION_DIR / "a100.json").exists()
    a100 = default_calibration(get_gpu("a100-80g-sxm"))
    assert "vTrain" in a100.source
    assert a100.other_bytes is not None  # resolved from the memory model's default
    b200 = default_calibration(get_gpu("b200"))
    assert "used for b200" in b200.source  # GB200's profile (tests/unit/test_accuracy_dgxc.py)
    assert default_calibration(get_gpu("l40s")).source.startswith("generic")  # no shipped profile


def test_a_profile_from_another_gpu_family_is_refused(tmp_path):
    path = tmp_path / "a100.json"
    CalibrationProfile(gpu="a100-80g-sxm").save(path)
    with pytest.raises(UsageError, match="h100-sxm"):
        load_calibration(path, get_gpu("h100-sxm"))


@pytest.mark.parametrize("data,message", [
    ({"gemm_efficiency": 0.0}, "gemm_efficiency"),
    ({"gemm_efficiency": 2.0}, "gemm_efficiency"),
    ({"layer_overhead_s": -1}, "layer_overhead_s"),
    ({"overlap_exponent": 0.5}, "overlap_exponent"),
    ({"link_efficiency": {"warp": 0.5}}, "link_efficiency"),
    ({"gemm_eficiency": 0.7}, "unknown keys"),
])
def test_bad_profiles_say_what_is_wrong(data, message):
    with pytest.raises(UsageError, match=message):
        CalibrationProfile.from_json(data)


def test_missing_and_malformed_files_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_calibration(tmp_path / "nope.json", get_gpu("h100-sxm"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_calibration(bad, get_gpu("h100-sxm"))


def test_efficiencies_move_the_prediction_the_right_way():
    model, cluster = load_model("13B"), load_cluster("dgx-h100", 16)
    training = TrainingSpec(seq_len=4096, global_batch_size=32)
    layout = Layout(tp=8, dp_replicate=2, micro_batch_size=1, grad_accum_steps=16)
    base = default_calibration(cluster.gpu)

    def step(**changes):
        return simulate_step(model, training, layout, cluster, base.replace(**changes)).step_time_s

    assert step(gemm_efficiency=0.4) > step() > step(gemm_efficiency=0.95)
    assert step(link_efficiency={"nvlink": 0.3, "nvls": 0.3}) > step()
    assert step(layer_overhead_s=0.05) > step()
