"""Async TP (TrainingSpec.async_tp): TP collectives pipelined with their GEMMs, priced and bounded."""

from __future__ import annotations

import dataclasses

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.model.load import load_model
from planner.search.bound import StepBound
from planner.simulate.calibration import load_calibration
from planner.simulate.compute import tokens_per_micro_batch
from planner.simulate.step import simulate_step
from planner.simulate.tp_overlap import overlap_gemms
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster

# TP-bound: tp 8 over NVLink with a short sequence per rank, and tp 16 across two nodes
CASES = {
    "70b-megatron-tp8": ("llama3-70b", 16, 8, 4096, "megatron", 1),
    "8b-torchtitan-tp8": ("llama3-8b", 8, 8, 8192, "torchtitan", 0),
    "70b-megatron-tp16-two-nodes": ("llama3-70b", 16, 16, 4096, "megatron", 0),
}


def _case(name: str, recompute: str = "none"):
    model_name, gpus, tp, seq, engine, zero = CASES[name]
    model, cluster = load_model(model_name), load_cluster("dgx-h100", gpus)
    dp = gpus // tp
    layout = Layout(tp=tp, dp_shard=dp, zero_stage=zero, sequence_parallel=True, micro_batch_size=1,
                    grad_accum_steps=4, recompute=recompute)
    training = TrainingSpec(seq_len=seq, global_batch_size=4 * dp, compile=engine == "torchtitan")
    return model, cluster, layout, training, engine


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_async_tp_hides_tp_comm_and_is_not_slower_on_tp_bound_layouts(name, recompute):
    model, cluster, layout, training, engine = _case(name, recompute)
    sync = simulate_step(model, training, layout, cluster, engine=engine)
    overlapped = simulate_step(model, training.replace(async_tp=True), layout, cluster, engine=engine)
    assert sync.time_breakdown_s["tp_comm"] > 0.08 * sync.step_time_s  # the case is TP-bound
    assert overlapped.time_breakdown_s["tp_comm"] < 0.75 * sync.time_breakdown_s["tp_comm"]
    assert overlapped.step_time_s < sync.step_time_s
    # the price of chunking: the GEMMs run as tp chunks, so compute grows (a little)
    assert sync.time_breakdown_s["compute"] < overlapped.time_breakdown_s["compute"] < \
        1.2 * sync.time_breakdown_s["compute"]


def test_chunking_cost_follows_the_gemm_shape_model():
    """tp chunks of m/tp rows cost what the knee says: zero with no knee, more with more chunks."""
    model, cluster, layout, training, _ = _case("70b-megatron-tp8")
    cal = load_calibration(None, cluster.gpu)
    m, peak = tokens_per_micro_batch(training.seq_len, layout), cluster.gpu.peak_flops("bf16")
    assert cal.gemm_knee > 0
    knee_free = dataclasses.replace(cal, gemm_knee=0.0)
    assert overlap_gemms(model, m, layout, peak, knee_free).chunking_s == pytest.approx(0.0, abs=1e-12)
    eight = overlap_gemms(model, m, layout, peak, cal)
    sixteen = overlap_gemms(model, m, layout.replace(tp=16, dp_shard=1, zero_stage=0), peak, cal)
    assert 0 < eight.chunking_s
    # per chunk the GEMMs are half as wide at tp 16 but there are twice as many chunks of half the rows
    assert sixteen.chunking_s / sum(sixteen.gather_s + sixteen.scatter_s) > \
        eight.chunking_s / sum(eight.gather_s + eight.scatter_s)


def test_compute_bound_layout_pays_only_the_chunking():
    """Long sequences on one NVLink node: TP hides anyway, and async TP cannot make it faster than compute."""
    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100", 8)
    layout = Layout(tp=2, dp_shard=4, zero_stage=1, sequence_parallel=True, micro_batch_size=4,
                    grad_accum_steps=2, recompute="full")
    training = TrainingSpec(seq_len=8192, global_batch_size=32)
    sync = simulate_step(model, training, layout, cluster, engine="megatron")
    overlapped = simulate_step(model, training.replace(async_tp=True), layout, cluster, engine="megatron")
    assert overlapped.time_breakdown_s["tp_comm"] <= sync.time_breakdown_s["tp_comm"]
    assert overlapped.time_breakdown_s["compute"] > sync.time_breakdown_s["compute"]


@pytest.mark.parametrize("name", list(CASES))
def test_bound_stays_below_async_tp_steps(name):
    model, cluster, layout, training, engine = _case(name)
    training = training.replace(async_tp=True)
    bound = StepBound(model, cluster, load_calibration(None, cluster.gpu), engine)
    for recompute in ("none", "full"):
        lay = layout.replace(recompute=recompute)
        step = simulate_step(model, training, lay, cluster, engine=engine).step_time_s
        assert bound.seconds(lay, training) <= step * (1 + 1e-9)


def test_async_tp_round_trips_through_plan_json_and_old_plans_load():
    base = TrainingSpec(seq_len=4096, global_batch_size=8)
    assert "async_tp" not in base.to_json()  # written only when true: old readers see the same keys
    on = base.replace(async_tp=True)
    assert on.to_json()["async_tp"] is True
    assert TrainingSpec.from_json(on.to_json()) == on
    assert TrainingSpec.from_json(base.to_json()).async_tp is False


def test_engines_refuse_async_tp_layouts_without_tp_and_sequence_parallel():
    model = load_model("llama3-8b")
    training = TrainingSpec(seq_len=4096, global_batch_size=8, async_tp=True)
    eng = get_engine("megatron")
    assert eng.refusal(model, Layout(tp=8, sequence_parallel=True), "bf16", True, training) is None
    assert "sequence parallel" in eng.refusal(model, Layout(tp=8), "bf16", True, training)
    assert "tp > 1" in eng.refusal(model, Layout(dp_replicate=8), "bf16", True, training)
    assert eng.refusal(model, Layout(dp_replicate=8), "bf16", True, training.replace(async_tp=False)) is None
