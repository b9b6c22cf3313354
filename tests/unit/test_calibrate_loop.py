"""Closing the loop on CPU ranks: plan shapes, per-collective scales, shared cores, per-part folding.

Every check runs on synthetic samples or simulated steps: no wall clock.
"""

from __future__ import annotations

import math

import pytest
from closed_loop_case import LAYOUTS, SMALL, TRAINING

from executor.calibrate.comm import CommSample
from executor.calibrate.fit import fit_collective_scale, fold_run
from executor.calibrate.fold import apply_levers, elasticities, fold_step
from executor.calibrate.kernels import threads_per_rank
from executor.calibrate.shapes import plan_shapes, tp_degrees
from planner.layout import Layout
from planner.plan import Plan, with_stage_layers
from planner.simulate.calibration import CalibrationProfile, load_calibration
from planner.simulate.compute import layer_gemms
from planner.simulate.step import simulate_step
from topologies.cluster_load import load_cluster
from topologies.collectives import CollectiveModel
from topologies.errors import UsageError
from topologies.hardware import get_gpu


def _plan(name: str) -> Plan:
    return Plan(model=SMALL, cluster=load_cluster("cpu", 2), training=TRAINING,
                layout=with_stage_layers(SMALL, LAYOUTS[name]))


def _step_s(plan: Plan, profile: CalibrationProfile) -> float:
    return simulate_step(plan.model, plan.training, plan.layout, plan.cluster, profile).step_time_s


def _cpu_profile() -> CalibrationProfile:
    return load_calibration(None, get_gpu("cpu"))


# ---- what calibrate measures -------------------------------------------------


def test_plan_shapes_are_the_simulators_gemms_at_each_tp_shard():
    shapes = plan_shapes(SMALL, 256, (2,), 2, 4)
    assert tp_degrees(SMALL, 2) == (1, 2) and tp_degrees(SMALL, 4) == (1, 2)  # 2 KV heads: no TP 4
    for tp in (1, 2):
        layout = Layout(tp=tp, micro_batch_size=2)
        for _, m, n, k in layer_gemms(SMALL, 512, layout):
            assert (int(m), int(n), int(k)) in shapes.gemm
        assert (512, 8192 // tp, 384) in shapes.gemm  # the vocabulary-parallel output layer
        assert (2, 6 // tp, 256, 64) in shapes.attention
    assert 512 * 384 * 4 in shapes.comm_bytes  # one TP all-reduce of the activations
    assert SMALL.total_params * 4 in shapes.comm_bytes  # the DDP gradient all-reduce
    assert shapes.adamw_params == SMALL.total_params


def test_threads_per_rank_follows_the_executor():
    assert threads_per_rank(2, 2) == 1 and threads_per_rank(2, 4) == 1 and threads_per_rank(16, 2) == 8
    assert threads_per_rank(16, 2, "1") == 1 and threads_per_rank(16, 2, "") == 8  # OMP_NUM_THREADS wins


def test_collective_scale_recovers_per_operation_factors():
    """Samples priced by the model with a known factor per op: the fit returns those factors."""
    cluster = load_cluster("cpu", 2)
    eff, latency = {"shm": 0.2}, 3.0
    model = CollectiveModel(cluster, efficiency=eff, latency_scale=latency)
    truth = {"all_reduce": 0.7, "all_gather": 2.0, "reduce_scatter": 2.9, "send_recv": 0.3}
    sizes = [1 << 16, 1 << 20, 1 << 24]
    samples = [CommSample(op, 2, size, f * model.time_s(op, size, (0, 1))) for op, f in truth.items()
               for size in sizes]
    fitted = fit_collective_scale(samples, cluster, eff, latency)
    assert fitted == pytest.approx(truth, rel=1e-9)
    # restricted to the plan's sizes, other sizes do not count
    skewed = samples + [CommSample("all_reduce", 2, 1 << 12, 100 * model.time_s("all_reduce", 1 << 12, (0, 1)))]
    assert fit_collective_scale(skewed, cluster, eff, latency, sizes)["all_reduce"] == pytest.approx(0.7)


# ---- how the simulator prices shared cores -----------------------------------


def test_profile_validates_the_shared_core_fields():
    with pytest.raises(UsageError, match="comm_overlap"):
        CalibrationProfile(comm_overlap=1.5)
    with pytest.raises(UsageError, match="collective_scale"):
        CalibrationProfile(collective_scale={"allreduce_typo": 2.0})
    profile = CalibrationProfile(comm_overlap=0.0, collective_scale={"all_gather": 2.0})
    assert CalibrationProfile.from_json(profile.to_json()) == profile
    assert _cpu_profile().comm_overlap == 0.0  # CPU ranks: gloo runs on the computing cores


def test_no_overlap_exposes_every_collective_and_overlap_hides_them():
    plan = _plan("zero3")
    shared = _cpu_profile().replace(comm_overlap=0.0)
    free = shared.replace(comm_overlap=1.0)
    exposed = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, shared).time_breakdown_s
    hidden = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, free).time_breakdown_s
    assert exposed["fsdp_comm"] > hidden["fsdp_comm"] >= 0.0
    assert exposed["compute"] == pytest.approx(hidden["compute"])


def test_root_units_of_zero3_are_gathered_and_reduced_per_micro_batch():
    """The embedding/output root is sharded too: its collectives scale with the micro-batch count."""
    base = _cpu_profile()
    slow_gather = base.replace(collective_scale={"all_gather": 10.0, "reduce_scatter": 10.0})
    plan = _plan("zero3")
    one = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, base).time_breakdown_s["fsdp_comm"]
    ten = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, slow_gather).time_breakdown_s
    assert ten["fsdp_comm"] == pytest.approx(10 * one, rel=1e-6)  # comm_overlap 0: nothing hidden


def test_collective_scale_moves_only_the_layouts_that_use_the_operation():
    base = _cpu_profile()
    slower = base.replace(collective_scale={"reduce_scatter": 5.0})
    assert _step_s(_plan("ddp"), slower) == pytest.approx(_step_s(_plan("ddp"), base))
    assert _step_s(_plan("zero3"), slower) > _step_s(_plan("zero3"), base)


# ---- folding one run -----------------------------------------------------------


def test_elasticities_name_the_parts_a_layout_exercises():
    base = _cpu_profile().replace(collective_scale={"all_reduce": 3.0})
    ddp = elasticities(lambda p: _step_s(_plan("ddp"), p), base)
    tp = elasticities(lambda p: _step_s(_plan("tp2"), p), base)
    assert ddp["compute"] > 0.5 and ddp["all_gather"] == 0.0 and ddp["reduce_scatter"] == 0.0
    assert tp["all_gather"] == 0.0 and tp["reduce_scatter"] == 0.0  # loss parallel: logits stay vocab-sharded
    assert tp["all_reduce"] > ddp["all_reduce"] > 0.0  # TP all-reduces activations in every layer


def test_fold_reproduces_the_run_and_splits_by_weight_and_prior():
    """A run made slower in compute and in its all-reduces: both levers move, unused ones stay."""
    plan = _plan("tp2")
    base = _cpu_profile().replace(collective_scale={"all_reduce": 3.0})
    truth = apply_levers(base, {"compute": 1.3, "all_reduce": 2.0})
    measured = _step_s(plan, truth)
    new, info = fold_step(lambda p: _step_s(plan, p), base, measured)
    assert info["reached"] and _step_s(plan, new) == pytest.approx(measured, rel=1e-6)
    assert info["levers"]["compute"] > 1.0 and info["levers"]["all_reduce"] > 1.0
    assert "reduce_scatter" not in info["levers"]  # TP without SP never reduce-scatters
    assert new.collective_scale.get("reduce_scatter", 1.0) == 1.0
    # the corrected profile is closer to the truth on another layout than the base was
    ddp = _plan("ddp")
    assert abs(math.log(_step_s(ddp, new) / _step_s(ddp, truth))) < abs(math.log(_step_s(ddp, base) /
                                                                                  _step_s(ddp, truth)))
    # folding the same measurement again changes nothing
    again, info2 = fold_step(lambda p: _step_s(plan, p), new, measured)
    assert again.gemm_efficiency == pytest.approx(new.gemm_efficiency, rel=1e-4) and not info2["levers"]


def test_fold_run_keeps_compute_factor_and_cpu_memory():
    plan = _plan("ddp")
    base = _cpu_profile()
    new, info = fold_run(plan, base, 0.5 * _step_s(plan, base), measured_peak_bytes=10**9)
    assert info["reached"] and info["compute_factor"] > 1.0  # a faster run: compute sped up
    assert new.other_bytes == base.other_bytes  # CPU peaks are resident sets, not tensors


def test_tp_ends_gather_no_logits():
    """Every engine keeps the logits split into its loss (DTensor's loss_parallel, Megatron's vocab-parallel
    cross entropy): the ends' TP communication is the embedding and output all-reduces, no all-gather."""
    plan = _plan("tp2")
    base = _cpu_profile()
    gathers = base.replace(collective_scale={"all_gather": 2.0})
    for engine in ("meshplan", "megatron", "torchtitan", "deepspeed"):
        one = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, base, engine=engine)
        two = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, gathers, engine=engine)
        assert two.time_breakdown_s["tp_comm"] == one.time_breakdown_s["tp_comm"] > 0


def test_block_fit_recovers_compute_level_dtensor_fsdp_and_solo_costs():
    """Block times made by the simulator's own layer and host model with known figures: the fit returns them."""
    from executor.calibrate.fit import fit_blocks
    from planner.memory.params import layer_params_split
    from planner.simulate.comm import StepComm
    from planner.simulate.compute import fsdp_copy_times, layer_times
    from planner.simulate.host import layer_host_s

    cluster, gpu = load_cluster("cpu", 2), get_gpu("cpu")
    base = _cpu_profile().replace(layer_overhead_s=2e-4, collective_overhead_s=1e-4,
                                  collective_scale={"all_gather": 2.0})
    truth = base.replace(gemm_efficiency=base.gemm_efficiency / 1.5, attention_efficiency=base.attention_efficiency
                         / 1.5, memory_efficiency=base.memory_efficiency / 1.5, dtensor_op_overhead_s=9e-5,
                         dtensor_ops_forward=5.0, dtensor_ops_backward=11.0, fsdp_call_overhead_s=3e-3)

    def block_s(layout: Layout, comm: float, calls: tuple[int, int]) -> float:
        lt = layer_times(SMALL, 256, 4, layout, gpu, gpu.peak_flops("fp32"), truth) + \
            fsdp_copy_times(SMALL, 4, 4, layout, gpu, truth)
        return lt.forward_s + lt.backward_s + comm + sum(layer_host_s(SMALL, layout, truth, 2e-4, calls))  # p = 1

    tp, z3 = Layout(tp=2, micro_batch_size=2), Layout(dp_shard=2, zero_stage=3, micro_batch_size=2)
    params = sum(layer_params_split(SMALL, 1, 1))
    z3_comm = StepComm(cluster, z3, truth)
    plain = block_s(Layout(micro_batch_size=2), 0.0, (0, 0))
    blocks = {"micro_batch": 2, "seq_len": 256, "world": 2, "plain": plain, "plain_solo": plain / 1.3,
              "tp": block_s(tp, 4 * StepComm(cluster, tp, truth).tp_point_s(512 * 384 * 4, False), (2, 2)),
              "tp_ops": [5.0, 11.0],
              "fsdp": block_s(z3, 2 * z3_comm.time_s("all_gather", params * 4, ("dp_shard",))
                              + z3_comm.time_s("reduce_scatter", params * 4, ("dp_shard",)), (1, 2))}
    changes = fit_blocks(base, gpu, "fp32", SMALL, cluster, blocks)
    assert changes["gemm_efficiency"] == pytest.approx(truth.gemm_efficiency, rel=1e-6)
    assert changes["dtensor_op_overhead_s"] == pytest.approx(9e-5, rel=1e-6)
    assert (changes["dtensor_ops_forward"], changes["dtensor_ops_backward"]) == (5.0, 11.0)
    assert changes["fsdp_call_overhead_s"] == pytest.approx(3e-3, rel=1e-6)
    assert changes["solo_speedup"] == pytest.approx(1.3)
    assert "collective_overhead_s" not in changes  # bare c10d calls are priced by the collective fit
