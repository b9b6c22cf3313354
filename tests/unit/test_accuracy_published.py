"""H100 calibration against published bf16 runs (bench/accuracy_published.py), and its mechanics.

Targets (bench TARGET_MAPE, 10% per source and split, justified there): the
shipped profile is the fit on FIT_MODELS only, so the "validate" MAPE is on
models it never saw. The A100 vTrain targets live in tests/test_accuracy.py.
"""

from __future__ import annotations

import pytest
from conftest import load_bench

from planner.layout import Layout
from planner.memory.params import layer_params_split
from planner.model.load import load_model
from planner.simulate.calibration import CalibrationProfile, default_calibration, load_calibration
from planner.simulate.compute import FSDP_COPY_PASSES, fsdp_copy_times, memory_time_s
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError
from topologies.hardware import get_gpu


@pytest.fixture(scope="module")
def bench():
    return load_bench("accuracy_published")


@pytest.fixture(scope="module")
def rows(bench):
    return bench.load_rows()


@pytest.fixture(scope="module")
def h100():
    return load_calibration(None, get_gpu("h100-sxm"))


def test_the_data_has_two_independent_stacks_with_held_out_models(bench, rows):
    groups = bench.groups(rows)
    assert {source for source, _ in groups} == {"llm-foundry", "nemo-dgxc"}
    for source in ("llm-foundry", "nemo-dgxc"):
        assert len(groups[(source, "fit")]) >= 8 and len(groups[(source, "validate")]) >= 4
        fit = {r.model_spec.name for r in groups[(source, "fit")]}
        assert fit.isdisjoint(r.model_spec.name for r in groups[(source, "validate")])


def test_model_shapes_reproduce_the_published_parameter_counts(rows):
    """LLM Foundry prints NumParams per row; the shapes in the data file must give exactly that."""
    counted = [r for r in rows if r.num_params is not None]
    assert len(counted) == 52
    for r in counted:
        assert r.model_spec.total_params == r.num_params, r.id


@pytest.mark.parametrize("source", ["llm-foundry", "nemo-dgxc"])
@pytest.mark.parametrize("split", ["fit", "validate"])
def test_mape_meets_the_target(bench, rows, h100, source, split):
    errors = bench.errors(bench.groups(rows)[(source, split)], h100)
    assert bench.mape(errors) <= bench.TARGET_MAPE
    # no systematic bias either way (2026-11-24: NeMo validate -5.0%, its four rows -3.7..-6.5%, since the
    # gradient average and ZeRO's gathers span dp x cp; the profile was fitted before that)
    assert abs(sum(errors) / len(errors)) < 0.06


def test_pytorch_fsdp_13b_on_16_h100_lands_in_the_published_range(h100):
    """meshplan's engine, ZeRO-3 over 16 GPUs: published PyTorch-FSDP runs on H100 reach 32.8-46.4% MFU
    (torchtitan Llama 3.1 8B FSDP: 33.7% on 8, 32.8% on 128 GPUs; LLM Foundry MPT FSDP: 39.6% for 13B on
    16 GPUs, 46.4% at most), NeMo's Megatron-Core 52-59% (dgxc-benchmarking READMEs)."""
    model, cluster = load_model("13B"), load_cluster("dgx-h100", 16)
    layout = Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, grad_accum_steps=16)
    result = simulate_step(model, TrainingSpec(seq_len=4096, global_batch_size=256), layout, cluster, h100)
    assert 0.328 <= result.mfu <= 0.464


def test_engine_factors_slow_only_their_engine(h100):
    meshplan, megatron = h100.for_engine("meshplan"), h100.for_engine("megatron")
    assert megatron.gemm_efficiency == h100.gemm_efficiency  # no factors: the base
    assert megatron.attention_efficiency == h100.attention_efficiency
    factors = h100.engine_factors["meshplan"]
    assert meshplan.attention_efficiency == pytest.approx(h100.attention_efficiency * factors["attention_efficiency"])
    assert meshplan.for_engine("megatron") is meshplan  # resolved profiles carry no factors: idempotent
    model, cluster = load_model("13B"), load_cluster("dgx-h100", 16)
    training, layout = TrainingSpec(seq_len=4096, global_batch_size=64), Layout(tp=8, dp_replicate=2,
                                                                                grad_accum_steps=32)
    fast = simulate_step(model, training, layout, cluster, h100, engine="megatron").step_time_s
    assert simulate_step(model, training, layout, cluster, h100.replace(engine_factors={})).step_time_s < \
        simulate_step(model, training, layout, cluster, h100).step_time_s
    assert fast < simulate_step(model, training, layout, cluster, h100, engine="deepspeed").step_time_s


@pytest.mark.parametrize("factors,message", [
    ({"meshplan": {"gemm_efficiency": 1.2}}, "never faster"),
    ({"meshplan": {"layer_overhead_s": 0.5}}, "keys are"),
    ({"jax": {"gemm_efficiency": 0.5}}, "engines"),
])
def test_bad_engine_factors_say_what_is_wrong(factors, message):
    with pytest.raises(UsageError, match=message):
        CalibrationProfile(engine_factors=factors)


def test_fsdp_copies_read_and_write_every_communicated_byte():
    model, gpu, cal = load_model("13B"), get_gpu("h100-sxm"), CalibrationProfile()
    params = sum(layer_params_split(model, 1, 1))
    zero3 = fsdp_copy_times(model, 2, 4, Layout(dp_shard=8, zero_stage=3), gpu, cal)
    assert zero3.forward_s == pytest.approx(memory_time_s(FSDP_COPY_PASSES * 2 * params, gpu, cal))
    assert zero3.backward_s == pytest.approx(memory_time_s(FSDP_COPY_PASSES * 6 * params, gpu, cal))
    zero2 = fsdp_copy_times(model, 2, 4, Layout(dp_shard=8, zero_stage=2), gpu, cal)
    assert zero2.forward_s == 0.0 and zero2.backward_s == pytest.approx(zero3.backward_s * 4 / 6)
    for layout in (Layout(dp_replicate=8), Layout(dp_shard=8, zero_stage=1)):
        assert fsdp_copy_times(model, 2, 4, layout, gpu, cal).backward_s == 0.0


def test_h200_shares_the_h100_profile_and_its_faster_memory_helps():
    h100, h200 = default_calibration(get_gpu("h100-sxm")), default_calibration(get_gpu("h200"))
    assert (h200.gemm_efficiency, h200.attention_efficiency) == (h100.gemm_efficiency, h100.attention_efficiency)
    assert h200.engine_factors == h100.engine_factors and "used for h200" in h200.source
    model, training = load_model("13B"), TrainingSpec(seq_len=4096, global_batch_size=256)
    layout = Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, grad_accum_steps=16)
    on = {name: simulate_step(model, training, layout, load_cluster(name, 16)).step_time_s
          for name in ("dgx-h100", "dgx-h200")}
    assert on["dgx-h200"] < on["dgx-h100"]  # same FLOP/s, 4.8 vs 3.35 TB/s for the memory-bound work
