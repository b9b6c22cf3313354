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
    per_sm_transfer,
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


def test_a_family_fit_carries_per_sm_to_its_other_parts(tmp_path):
    """B200 (148 SMs, rated 2.25 PF bf16) sustains GB200's FLOP/s per SM, not GB200's share of its own rating;
    GB300's 160 SMs at GB200's rating sustain 160/148 of GB200's rate; memory-bound work is not scaled."""
    gb200, b200, gb300 = get_gpu("gb200"), get_gpu("b200"), get_gpu("gb300")
    fitted = CalibrationProfile(gpu="gb200", gemm_efficiency=0.5, fp8_gemm_efficiency=0.45, attention_efficiency=0.7,
                                memory_efficiency=0.8)
    on_b200, on_gb300 = per_sm_transfer(fitted, gb200, b200), per_sm_transfer(fitted, gb200, gb300)
    assert on_b200.gemm_efficiency * b200.bf16_flops == pytest.approx(fitted.gemm_efficiency * gb200.bf16_flops)
    assert on_b200.fp8_gemm_efficiency == pytest.approx(0.45 * 5000 / 4500)
    assert on_gb300.attention_efficiency == pytest.approx(0.7 * 160 / 148)
    assert on_b200.memory_efficiency == on_gb300.memory_efficiency == 0.8
    assert "per SM" in on_gb300.source
    assert per_sm_transfer(fitted, gb200, gb200) is fitted
    # same rated FLOP/s per SM: kept as fitted (H200 is the H100 die)
    h100 = CalibrationProfile(gpu="h100-sxm", gemm_efficiency=0.7)
    assert per_sm_transfer(h100, get_gpu("h100-sxm"), get_gpu("h200")) == h100
    # a profile file measured on a family member takes the same road as the shipped one
    path = tmp_path / "gb200.json"
    fitted.save(path)
    assert load_calibration(path, b200).gemm_efficiency == pytest.approx(on_b200.gemm_efficiency)
    assert default_calibration(b200).gemm_efficiency > default_calibration(gb200).gemm_efficiency


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


def test_a100_borrows_the_pytorch_native_memory_factor_from_h100():
    """The A100 profile (fitted on Megatron-DeepSpeed) takes the H100 engines' memory-bound factor, a
    property of eager PyTorch's kernel graph, and no attention factor (FlashAttention-2 on both stacks)."""
    a100, h100 = default_calibration(get_gpu("a100-80g-sxm")), default_calibration(get_gpu("h100-sxm"))
    for engine in ("torchtitan", "meshplan"):
        assert a100.engine_factors[engine] == {"memory_efficiency": h100.engine_factors[engine]["memory_efficiency"]}
        resolved = a100.for_engine(engine)
        assert resolved.memory_efficiency == pytest.approx(a100.memory_efficiency * h100.engine_factors[engine]
                                                           ["memory_efficiency"])
        assert resolved.attention_efficiency == a100.attention_efficiency
    for engine in ("megatron", "deepspeed"):  # vTrain's stack: the profile's own rates
        assert a100.for_engine(engine).memory_efficiency == a100.memory_efficiency
    assert "engine factors from the h100 profile" in a100.source


def test_a_profile_keeps_its_own_engine_factors(tmp_path):
    from planner.simulate import calibration

    own = CalibrationProfile(gpu="a100-80g-sxm", engine_factors={"torchtitan": {"memory_efficiency": 0.9}})
    lent = calibration._transferred(own, "a100")
    assert lent.engine_factors["torchtitan"] == {"memory_efficiency": 0.9}
    assert "meshplan" in lent.engine_factors and calibration._transferred(own, "b200") is own
    path = tmp_path / "a100.json"
    own.save(path)  # a measured profile given with --calibration is taken as it is
    assert load_calibration(path, get_gpu("a100-80g-sxm")).engine_factors == own.engine_factors


def test_torchtitan_on_a100_is_slower_than_megatron_by_its_memory_bound_work():
    cluster = load_cluster("dgx-a100-80g", 8)
    model = load_model("llama3-8b")
    training = TrainingSpec(seq_len=4096, global_batch_size=8)
    layout = Layout(dp_shard=8, zero_stage=3, micro_batch_size=1, grad_accum_steps=1)
    a100 = default_calibration(cluster.gpu)
    steps = {e: simulate_step(model, training, layout, cluster, a100, engine=e).step_time_s
             for e in ("megatron", "torchtitan")}
    assert steps["torchtitan"] > 1.05 * steps["megatron"]
    bare = a100.replace(engine_factors={})  # the same stack traits: only the borrowed factor tells them apart
    assert simulate_step(model, training, layout, cluster, bare, engine="torchtitan").step_time_s == \
        pytest.approx(steps["megatron"])
