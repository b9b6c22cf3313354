"""simulate_step: one step's time, its breakdown, and the properties a planner relies on."""

from __future__ import annotations

import dataclasses

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import MEMORY_CATEGORIES, with_stage_layers
from planner.simulate.calibration import load_calibration
from planner.simulate.step import compute_lower_bound_s, simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError

MODEL = load_model("13B")
H100_16 = load_cluster("dgx-h100", 16)
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=64)
PARTS = ("compute", "exposed_comm", "bubble", "optimizer")
EXPOSED = ("tp_comm", "cp_comm", "ep_comm", "fsdp_comm", "offload_comm", "dp_comm", "param_gather", "embedding_sync")

LAYOUTS = [
    Layout(tp=8, dp_replicate=2, micro_batch_size=1, grad_accum_steps=32),
    Layout(tp=4, pp=4, micro_batch_size=1, grad_accum_steps=64, recompute="selective", sequence_parallel=True),
    Layout(tp=2, pp=2, dp_shard=4, zero_stage=3, micro_batch_size=2, grad_accum_steps=8, recompute="full"),
    Layout(tp=2, pp=4, dp_replicate=2, micro_batch_size=1, grad_accum_steps=32, pp_schedule="interleaved-1f1b",
           virtual_stages=2),
    Layout(tp=4, pp=2, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=32, pp_schedule="zb-v",
           virtual_stages=2),
    Layout(tp=2, cp=2, dp_replicate=2, dp_shard=2, zero_stage=2, micro_batch_size=2, grad_accum_steps=8),
    Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, grad_accum_steps=4, recompute="full"),
]


def run(layout, model=MODEL, cluster=H100_16, training=TRAINING, **kw):
    return simulate_step(model, training, layout, cluster, **kw)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"tp{lay.tp}pp{lay.pp}z{lay.zero_stage}{lay.pp_schedule}")
def test_breakdown_sums_to_the_step_and_the_bound_holds(layout):
    result = run(layout)
    b = result.time_breakdown_s
    assert sum(b[k] for k in PARTS) == pytest.approx(result.step_time_s, rel=1e-9)
    assert b["exposed_comm"] == pytest.approx(sum(b[k] for k in EXPOSED))
    assert all(v >= 0 for v in b.values())
    assert compute_lower_bound_s(MODEL, TRAINING, layout, H100_16) <= result.step_time_s
    assert result.tokens_per_s == pytest.approx(TRAINING.tokens_per_step / result.step_time_s)
    assert 0 < result.mfu < 1
    peak = H100_16.gpu.peak_flops("bf16")
    assert result.mfu == pytest.approx(result.model_tflops_per_gpu * 1e12 / peak)


def test_mfu_uses_model_flops_without_recompute():
    """Recomputation costs time, but MFU counts 6N + attention only (PaLM's definition)."""
    base = Layout(tp=8, dp_replicate=2, micro_batch_size=1, grad_accum_steps=32)
    plain, full = run(base), run(base.replace(recompute="full"))
    assert full.step_time_s > plain.step_time_s
    expected = MODEL.model_flops_per_token(4096) * full.tokens_per_s / 16 / H100_16.gpu.peak_flops("bf16")
    assert full.mfu == pytest.approx(expected)
    assert full.mfu < plain.mfu


def test_prediction_has_the_plan_json_contract_keys():
    pred = run(LAYOUTS[1]).prediction().to_json()
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes",
                "memory_breakdown_bytes", "time_breakdown_s"):
        assert key in pred
    assert set(pred["memory_breakdown_bytes"]) == set(MEMORY_CATEGORIES)
    assert {"compute", "exposed_comm", "bubble", "optimizer"} <= set(pred["time_breakdown_s"])


def test_tensor_parallel_group_across_nodes_pays_the_network():
    """Slower NICs slow a TP group that spans two nodes, and leave one inside a node untouched."""
    model = load_model("llama2-70b")
    slow_nics = load_cluster("dgx-h100", 16, {"nic_gbit_per_s": "50"})
    inside = Layout(tp=8, dp_replicate=2, micro_batch_size=1, grad_accum_steps=32)
    across = Layout(tp=16, micro_batch_size=1, grad_accum_steps=64)
    tp_comm = {(name, c.name + str(c.nic_gbit_per_s)): run(lay, model=model, cluster=c).time_breakdown_s["tp_comm"]
               for name, lay in (("inside", inside), ("across", across)) for c in (H100_16, slow_nics)}
    fast, slow = H100_16.name + "400.0", slow_nics.name + "50.0"
    assert tp_comm[("inside", slow)] == pytest.approx(tp_comm[("inside", fast)])
    assert tp_comm[("across", slow)] > 2 * tp_comm[("across", fast)]


def test_more_micro_batches_shrink_the_bubble_share():
    shares = []
    for accum in (4, 8, 16, 64):
        training = TrainingSpec(seq_len=4096, global_batch_size=accum)
        r = run(Layout(tp=4, pp=4, micro_batch_size=1, grad_accum_steps=accum), training=training)
        shares.append(r.time_breakdown_s["bubble"] / r.step_time_s)
    assert shares == sorted(shares, reverse=True)


def test_interleaving_and_zero_bubble_cut_the_1f1b_bubble():
    training = TrainingSpec(seq_len=4096, global_batch_size=8)
    common = dict(tp=4, pp=4, micro_batch_size=1, grad_accum_steps=8)
    bubble = {name: run(Layout(**common, **kw), training=training).time_breakdown_s["bubble"]
              for name, kw in (("1f1b", {}), ("interleaved", {"pp_schedule": "interleaved-1f1b", "virtual_stages": 2}),
                               ("zb-v", {"pp_schedule": "zb-v", "virtual_stages": 2}))}
    assert bubble["interleaved"] < bubble["1f1b"]
    assert bubble["zb-v"] < bubble["1f1b"]


def test_overlapping_the_dp_reduction_hides_part_of_it():
    layout = Layout(tp=2, dp_replicate=8, micro_batch_size=1, grad_accum_steps=8)
    meshplan = get_engine("meshplan")  # the same engine with its gradient reduction after the backward
    serial_dp = dataclasses.replace(meshplan.data_parallel, overlaps_backward=False)
    overlapped = run(layout, engine=meshplan)
    serial = run(layout, engine=dataclasses.replace(meshplan, data_parallel=serial_dp))
    assert 0 < overlapped.time_breakdown_s["dp_comm"] < serial.time_breakdown_s["dp_comm"]
    assert overlapped.step_time_s < serial.step_time_s


def test_eager_attention_engines_are_slower_on_long_sequences():
    training = TrainingSpec(seq_len=8192, global_batch_size=32)
    layout = Layout(tp=8, dp_replicate=2, micro_batch_size=1, grad_accum_steps=16)
    assert get_engine("deepspeed").attention == "eager"
    assert run(layout, training=training, engine="deepspeed").step_time_s > \
        run(layout, training=training, engine="meshplan").step_time_s


def test_an_overloaded_stage_sets_the_pace():
    """19 of 40 layers on one stage: the steady state runs at that stage's rate (~1.9x the balanced one)."""
    training = TrainingSpec(seq_len=4096, global_batch_size=32)
    base = Layout(tp=4, pp=4, micro_batch_size=1, grad_accum_steps=32)
    balanced = run(with_stage_layers(MODEL, base), training=training)
    skewed = run(base.replace(layers_per_stage=(7, 7, 7, 19)), training=training)
    assert skewed.step_time_s > 1.5 * balanced.step_time_s
    assert skewed.time_breakdown_s["bubble"] > balanced.time_breakdown_s["bubble"]


def test_memory_comes_from_the_memory_model():
    from planner.memory.estimate import estimate_memory

    layout = with_stage_layers(MODEL, LAYOUTS[1])
    cal = load_calibration(None, H100_16.gpu)
    expected = estimate_memory(MODEL, TRAINING, layout, H100_16.gpu, "meshplan", cal.other_bytes)
    assert run(layout).memory.peak_bytes == expected.peak_bytes


def test_offloading_costs_time():
    """ZeRO-Offload trades memory for host-link copies and a host-side optimizer step: never faster than none.
    Parameter offload copies every unit's shard up in each pass (more bytes than optimizer offload's one upload
    after the step) but prefetches them under compute, so which of the two is slower depends on how much
    compute hides: with a layer's compute large (70B) the one exposed upload weighs more; with a short
    sequence on PCIe Gen3 the per-pass copies do."""
    base = Layout(tp=2, dp_shard=8, zero_stage=3, micro_batch_size=1, grad_accum_steps=8)
    times = [run(base.replace(offload=o)) for o in ("none", "optimizer", "optimizer+params")]
    assert times[0].time_breakdown_s["optimizer"] < times[1].time_breakdown_s["optimizer"]
    assert times[0].step_time_s < min(times[1].step_time_s, times[2].step_time_s)
    assert times[1].offload["up_bytes"] < times[2].offload["up_bytes"]
    gen3 = dataclasses.replace(H100_16, gpu=dataclasses.replace(H100_16.gpu, pcie_gen=3))
    short = TrainingSpec(seq_len=256, global_batch_size=TRAINING.global_batch_size)
    slow = [run(base.replace(offload=o), cluster=gen3, training=short) for o in ("optimizer", "optimizer+params")]
    assert slow[0].step_time_s < slow[1].step_time_s


def test_layout_for_another_world_size_is_refused():
    with pytest.raises(PlanError, match="16 GPUs"):
        run(Layout(tp=8, micro_batch_size=1, grad_accum_steps=64))


def test_moe_with_expert_parallelism_pays_all_to_all():
    model = load_model("mixtral-8x7b")
    training = TrainingSpec(seq_len=4096, global_batch_size=32)
    layout = Layout(tp=2, dp_shard=8, ep=8, zero_stage=3, micro_batch_size=1, grad_accum_steps=4)
    result = run(layout, model=model, training=training)
    assert result.time_breakdown_s["ep_comm"] > 0
    assert compute_lower_bound_s(model, training, layout, H100_16) <= result.step_time_s
