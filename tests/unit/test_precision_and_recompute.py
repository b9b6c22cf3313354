"""Precision (fp8/mxfp8), attention kernel, compile and per-op selective checkpointing; torchtitan; new parts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from planner.engines import ENGINES, executor_refusal, get_engine
from planner.layout import Layout
from planner.memory.activations import layer_activation_bytes, layer_activation_terms, op_saved_terms
from planner.memory.estimate import estimate_memory
from planner.model.load import load_model
from planner.plan import Plan
from planner.search.candidates import Pins
from planner.search.search import search
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec, training_for
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError, TopologyError
from topologies.hardware import get_gpu

LLAMA8 = load_model("llama3-8b")


def test_precision_defaults_to_the_dtype_and_fp8_keeps_a_bf16_model():
    assert TrainingSpec(seq_len=8, global_batch_size=1).precision == "bf16"
    assert TrainingSpec(seq_len=8, global_batch_size=1, dtype="fp32").precision == "fp32"
    fp8 = training_for(8, 1, "fp8")
    assert (fp8.dtype, fp8.precision, fp8.fp8, fp8.dtype_bytes) == ("bf16", "fp8", True, 2)
    with pytest.raises(PlanError, match="precision 'fp16' with dtype 'bf16'"):
        TrainingSpec(seq_len=8, global_batch_size=1, precision="fp16")
    with pytest.raises(PlanError, match="attention must be one of"):
        TrainingSpec(seq_len=8, global_batch_size=1, attention="flash")


def test_mxfp8_only_on_blackwell():
    assert get_gpu("gb200").peak_flops("mxfp8") == get_gpu("gb200").peak_flops("fp8") == 5e15
    for name in ("h100-sxm", "h800", "a100-80g-sxm"):
        with pytest.raises(TopologyError, match="no mxfp8"):
            get_gpu(name).peak_flops("mxfp8")


def test_fp8_steps_are_faster_but_not_twice():
    cluster, layout = load_cluster("dgx-h100", 8), Layout(dp_shard=8, zero_stage=1, grad_accum_steps=2)
    bf16 = simulate_step(LLAMA8, training_for(8192, 16, "bf16"), layout, cluster, engine="megatron").step_time_s
    fp8 = simulate_step(LLAMA8, training_for(8192, 16, "fp8"), layout, cluster, engine="megatron").step_time_s
    assert 1.15 < bf16 / fp8 < 2.0


def test_te_saves_fp8_linear_inputs_torchao_does_not():
    training, layout = training_for(4096, 8, "fp8"), Layout(dp_shard=8, zero_stage=1, grad_accum_steps=1)
    bf16 = training_for(4096, 8, "bf16")
    gpu = get_gpu("h100-sxm")
    for engine, smaller in (("megatron", True), ("torchtitan", False)):
        a8 = estimate_memory(LLAMA8, training, layout, gpu, engine).activations.per_layer
        a16 = estimate_memory(LLAMA8, bf16, layout, gpu, engine).activations.per_layer
        assert (a8 < a16) is smaller


def test_op_sac_keeps_torchtitans_save_list():
    """Every second mm of a block saved (wq, wv, w1, w2 for Llama), plus SDPA's output and log-sum-exp."""
    saved = op_saved_terms(LLAMA8, 1024, 1)
    h, q, kv, f = LLAMA8.hidden, LLAMA8.q_dim, LLAMA8.kv_dim, LLAMA8.ffn_hidden
    assert set(saved) == {"mm_wq", "mm_wv", "mm_w1", "mm_w2", "sdpa_output", "sdpa_logsumexp"}
    assert sum(saved.values()) == pytest.approx(1024 * (2 * (q + kv + f + h + q) + 4 * LLAMA8.n_heads))
    assert "sdpa_output" not in op_saved_terms(LLAMA8, 1024, 1, fused_attention=False)
    terms = layer_activation_terms(LLAMA8, 1024, 1)
    kept = {r: layer_activation_bytes(terms, r, saved)[0] for r in ("none", "selective", "op", "full")}
    assert kept["none"] > kept["selective"] > kept["op"] > kept["full"]


def test_torchtitans_published_8b_run_fits_with_op_sac():
    """torchtitan Llama 3.1 8B, FSDP over 8 GPUs, local batch 2 at 8192, per-op SAC: 82.4 GiB measured on
    96 GB H100s (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1); without recomputation
    it does not fit.

    The published figure is the caching allocator's reserved peak (planner.memory.reserved; the meshplan
    engine's figures for 8 and 128 GPUs: tests/unit/test_memory_reserved.py)."""
    h100_96 = dataclasses.replace(get_gpu("h100-sxm"), memory_bytes=96 * 10**9)
    training, layout = training_for(8192, 16, "bf16"), Layout(dp_shard=8, zero_stage=3, micro_batch_size=2)
    op = estimate_memory(LLAMA8, training, layout.replace(recompute="op"), h100_96, "torchtitan")
    none = estimate_memory(LLAMA8, training, layout, h100_96, "torchtitan").peak_bytes
    assert abs(op.reserved_bytes / 2**30 / 82.4 - 1) <= 0.15
    assert none > h100_96.memory_bytes > op.peak_bytes


def test_compile_speeds_up_only_the_memory_bound_work():
    cluster, layout = load_cluster("dgx-h100", 8), Layout(dp_shard=8, zero_stage=3, micro_batch_size=1,
                                                          grad_accum_steps=2, recompute="op")
    eager = simulate_step(LLAMA8, training_for(8192, 16), layout, cluster, engine="torchtitan").step_time_s
    compiled = simulate_step(LLAMA8, training_for(8192, 16, compile=True), layout, cluster,
                             engine="torchtitan").step_time_s
    assert 1.03 < eager / compiled < 1.3


def test_eager_attention_costs_time_and_the_s_squared_memory():
    cluster, layout = load_cluster("dgx-h100", 8), Layout(tp=8, grad_accum_steps=4)
    gpt = load_model("gpt3-175b")
    small = dataclasses.replace(gpt, n_layers=8)
    fused, eager = (simulate_step(small, TrainingSpec(seq_len=2048, global_batch_size=4, attention=a), layout,
                                  cluster, engine="megatron") for a in ("fused", "eager"))
    assert eager.step_time_s > fused.step_time_s
    assert eager.memory.activations.per_layer > fused.memory.activations.per_layer


def test_engines_name_their_recompute_kinds_and_the_executor_refuses_fp8():
    assert get_engine("torchtitan").recompute_kinds == ("none", "op", "full")
    assert "op" not in get_engine("megatron").recompute_kinds
    fp8 = training_for(8, 1, "fp8")
    assert executor_refusal(LLAMA8, Layout(), "bf16", on_gpu=False, training=fp8).startswith("precision fp8 on CPU")
    assert executor_refusal(LLAMA8, Layout(), training=fp8) is None  # torchao float8 (executor.components.float8)
    assert "tensor-parallel" in executor_refusal(LLAMA8, Layout(tp=2), training=fp8)
    assert "mxfp8" in executor_refusal(LLAMA8, Layout(), training=training_for(8, 1, "mxfp8"))
    assert executor_refusal(LLAMA8, Layout(recompute="op")) is None  # per-op SAC runs (executor.parallel.recompute)
    assert get_engine("megatron").refusal(LLAMA8, Layout(recompute="op"), "bf16", True)
    assert set(ENGINES) >= {"meshplan", "megatron", "deepspeed", "torchtitan"}


def test_search_tries_op_for_torchtitan_and_never_for_megatron():
    cluster = load_cluster("dgx-h100", 8)
    tt = search(LLAMA8, cluster, 8192, 16, Pins(dp_shard=8, zero_stage=3), "torchtitan", top_k=5)
    assert tt.ranked and {s.layout.recompute for s in tt.ranked} <= {"none", "op", "full"}
    mg = search(LLAMA8, cluster, 8192, 16, Pins(tp=8), "megatron", top_k=5, precision="fp8")
    assert mg.ranked and all(s.layout.recompute != "op" and s.training.precision == "fp8" for s in mg.ranked)


@pytest.mark.parametrize("preset,gpus,domain", [("gb200-nvl72", 72, 72), ("gb200-nvl72", 128, 64),
                                                ("gb300-nvl72", 512, 64), ("gb200-nvl72", 144, 72)])
def test_nvl72_racks_are_one_nvlink_domain_used_in_whole_trays(preset, gpus, domain):
    cluster = load_cluster(preset, gpus)
    assert cluster.gpus_per_node == domain and cluster.world_size == gpus and cluster.gpus_per_tray == 4
    assert cluster.nics_per_node == domain  # one NIC per GPU


def test_tp_of_a_whole_domain_stays_on_nvlink():
    cluster = load_cluster("gb200-nvl72", 128)
    one_box = load_cluster("dgx-b200", 128)
    model = load_model("llama3-70b")
    layout = Layout(tp=64, dp_replicate=2, grad_accum_steps=8, sequence_parallel=True)
    training = TrainingSpec(seq_len=8192, global_batch_size=16)
    rack = simulate_step(model, training, layout, cluster).time_breakdown_s["tp_comm"]
    boxes = simulate_step(model, training, layout, one_box).time_breakdown_s["tp_comm"]
    assert rack < boxes / 2


@pytest.mark.parametrize("preset,gpu", [("dgx-b300", "b300"), ("hgx-h800", "h800")])
def test_new_presets_load(preset, gpu):
    cluster = load_cluster(preset, 16)
    assert cluster.gpu.name == gpu and cluster.n_nodes == 2


def test_version_1_plans_load_with_defaults():
    training = TrainingSpec(seq_len=128, global_batch_size=8)
    plan = Plan(model=load_model("debug"), cluster=load_cluster("cpu", 1), training=training,
                layout=Layout(grad_accum_steps=8), engine="deepspeed")
    data = json.loads(json.dumps(plan.to_json()))
    assert data["schema_version"] == 3 and data["training"]["precision"] == "bf16"
    data["schema_version"] = 1
    for key in ("precision", "attention", "compile"):
        del data["training"][key]
    old = Plan.from_json(data)
    assert (old.training.precision, old.training.attention, old.training.compile) == ("bf16", "eager", False)


def test_partial_full_recompute_sits_between_none_and_full():
    """Megatron's --recompute-method block --recompute-num-layers N: the first N layers of each chunk."""
    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100", 64)
    base = Layout(tp=8, pp=4, dp_shard=2, zero_stage=1, grad_accum_steps=8, sequence_parallel=True)
    training = TrainingSpec(seq_len=8192, global_batch_size=16)
    runs = {n: simulate_step(model, training, base.replace(recompute="full", recompute_layers=n), cluster,
                             engine="megatron") for n in (0, 5, 10)}
    none = simulate_step(model, training, base, cluster, engine="megatron")
    times = [none.step_time_s, runs[5].step_time_s, runs[10].step_time_s, runs[0].step_time_s]
    memory = [none.memory.peak_bytes, runs[5].memory.peak_bytes, runs[10].memory.peak_bytes, runs[0].memory.peak_bytes]
    assert times == sorted(times) and memory == sorted(memory, reverse=True)
    with pytest.raises(PlanError, match="applies to recompute 'full'"):
        Layout(recompute="selective", recompute_layers=2)


def test_search_tries_partial_recompute_only_where_the_engine_has_it():
    model, cluster = load_model("405B"), load_cluster("dgx-h100", 8192)
    pins = Pins(tp=8, pp=16, dp=64, pp_schedule="interleaved-1f1b")
    mega = search(model, cluster, 8192, 2048, pins, "megatron", top_k=3)
    assert mega.best.layout.recompute == "full" and mega.best.layout.recompute_layers > 0
    pinned = search(model, cluster, 8192, 2048, dataclasses.replace(pins, recompute="full"), "megatron", top_k=1)
    assert pinned.best.layout.recompute_layers == 0
    assert pinned.best.result.step_time_s > mega.best.result.step_time_s


def test_transformer_engine_keeps_fp8_weight_copies_torchao_does_not():
    layout, gpu = Layout(tp=8, pp=2, grad_accum_steps=8, sequence_parallel=True), get_gpu("h100-sxm")
    model = load_model("llama3-70b")
    for engine, copies in (("megatron", True), ("torchtitan", False)):
        fp8, bf16 = (estimate_memory(model, training_for(4096, 8, p), layout, gpu, engine).per_stage[0]["params"]
                     for p in ("fp8", "bf16"))
        assert (fp8 > bf16) is copies
    # Transformer Engine's cached workspace beside the bf16 weights: data and transpose on Hopper (TN-only FP8
    # GEMMs), the data alone on Blackwell, row- and column-wise block-scaled copies under MXFP8; with 8-bit
    # parameters (fp8_params) those copies replace the bf16 weights
    cases = (("h100-sxm", "fp8", False, 2.0), ("b200", "fp8", False, 1.0), ("b200", "mxfp8", False, 2 * 33 / 32),
             ("h100-sxm", "fp8", True, 0.0), ("b200", "fp8", True, -1.0), ("b200", "mxfp8", True, 2 * 33 / 32 - 2))
    for part, precision, primary, extra_per_param in cases:
        gpu = get_gpu(part)
        bf16 = estimate_memory(model, training_for(4096, 8, "bf16"), layout, gpu, "megatron").per_stage[0]["params"]
        fp8 = estimate_memory(model, training_for(4096, 8, precision, fp8_params=primary), layout, gpu,
                              "megatron").per_stage[0]["params"]
        assert get_engine("megatron").fp8_weight_bytes(training_for(4096, 8, precision), gpu.fp8_any_layout) == \
            pytest.approx(extra_per_param + (2 if primary else 0))
        # the stage's parameters are nearly all block linears (2 B each in bf16)
        assert fp8 - bf16 == pytest.approx(extra_per_param / 2 * bf16, rel=0.1, abs=0.02 * bf16), (part, precision)


def test_new_parts_take_their_familys_fitted_profile():
    from planner.simulate.calibration import default_calibration

    h100, gb200 = default_calibration(get_gpu("h100-sxm")), default_calibration(get_gpu("gb200"))
    assert "gb200" in gb200.fits and gb200.fp8_gemm_efficiency < 1.0
    for part, family, source in (("h800", h100, "h100-sxm"), ("h200", h100, "h100-sxm"), ("gb300", gb200, "gb200"),
                                 ("b300", gb200, "gb200"), ("b200", gb200, "gb200")):
        gpu, fitted = get_gpu(part), get_gpu(source)
        profile = default_calibration(gpu)
        # the sustained FLOP/s per SM of the part the family was fitted on (calibration.per_sm_transfer), times
        # the part's measured rate per SM where the profile names one (Blackwell Ultra on the GB200 profile)
        measured = family.part_sm_rate.get(part, 1.0)
        assert (measured > 1.0) == (part in ("gb300", "b300"))
        for key, dtype in (("gemm_efficiency", "bf16"), ("fp8_gemm_efficiency", "fp8")):
            ours = getattr(profile, key) * getattr(gpu, f"{dtype}_flops") / gpu.sm_count
            theirs = getattr(family, key) * getattr(fitted, f"{dtype}_flops") / fitted.sm_count
            assert ours == pytest.approx(theirs * measured, rel=1e-9), (part, key)


def test_torchtitan_has_no_optimizer_only_sharding():
    tt = get_engine("torchtitan")
    assert "ZeRO-1" in tt.refusal(LLAMA8, Layout(dp_shard=8, zero_stage=1), "bf16", True)
    result = search(LLAMA8, load_cluster("dgx-h100", 8), 4096, 256, Pins(), "torchtitan", top_k=5)
    assert result.ranked and all(s.layout.zero_stage != 1 for s in result.ranked)


def test_op_sac_keeps_the_same_gemm_outputs_under_float8():
    """torchao's float8 linear calls torch.mm on its float8 tensors, so the per-op SAC policy counts and
    saves the same projections as in bf16 (torchtitan's H100 table: 77.0 GiB compiled bf16, 76.8 GiB
    with float8): the activations kept do not change, and the recompute redoes the same GEMMs, at the
    8-bit rate."""
    model, cluster = load_model("8B"), load_cluster("dgx-h100", 8)
    layout = Layout(dp_shard=8, zero_stage=3, micro_batch_size=1, grad_accum_steps=1, recompute="op")
    fp8, bf16 = training_for(8192, 8, "fp8"), training_for(8192, 8, "bf16")
    for engine in ("torchtitan", "meshplan"):
        mem = {t.precision: estimate_memory(model, t, layout, cluster.gpu, engine).breakdown_bytes["activations"]
               for t in (fp8, bf16)}
        assert mem["fp8"] == pytest.approx(mem["bf16"], rel=0.05)
        fast, slow = (simulate_step(model, t, layout, cluster, engine=engine) for t in (fp8, bf16))
        assert fast.time_breakdown_s["compute"] < 0.95 * slow.time_breakdown_s["compute"]
