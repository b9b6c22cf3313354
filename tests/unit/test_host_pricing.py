"""Host work of TP and FSDP, shared-core speed of pipeline stages, and how a run's update splits them.

Simulated steps and a fake process group only: no wall clock.
"""

from __future__ import annotations

import math

import pytest
from closed_loop_case import LAYOUTS, SMALL, TRAINING

from executor.calibrate.fold import apply_levers, describe, fold_step
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.plan import Plan, with_stage_layers
from planner.simulate.calibration import CalibrationProfile, load_calibration
from planner.simulate.host import alone_factors, dtensor_ops, tp_linears_per_layer
from planner.simulate.pipeline import Op
from planner.simulate.step import simulate_step
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError
from topologies.hardware import get_gpu


def _step_s(name: str, profile: CalibrationProfile) -> float:
    plan = Plan(model=SMALL, cluster=load_cluster("cpu", 2), training=TRAINING,
                layout=with_stage_layers(SMALL, LAYOUTS[name]))
    return simulate_step(plan.model, plan.training, plan.layout, plan.cluster, profile).step_time_s


def _cpu() -> CalibrationProfile:
    return load_calibration(None, get_gpu("cpu"))  # overlap_exponent 1: host time adds to kernel time


def test_new_fields_validate_and_old_profiles_load():
    with pytest.raises(UsageError, match="solo_speedup"):
        CalibrationProfile(solo_speedup=0.5)
    with pytest.raises(UsageError, match="dtensor_op_overhead_s"):
        CalibrationProfile(dtensor_op_overhead_s=-1e-6)
    old = {k: v for k, v in CalibrationProfile().to_json().items()
           if k not in ("dtensor_op_overhead_s", "dtensor_ops_forward", "dtensor_ops_backward",
                        "fsdp_call_overhead_s", "solo_speedup")}
    assert CalibrationProfile.from_json(old).solo_speedup == 1.0  # a profile written before these fields


def test_dtensor_host_time_is_priced_per_operator_under_tp_only():
    base = _cpu()
    cost = 1e-4
    slow = base.replace(dtensor_op_overhead_s=cost)
    for name in ("ddp", "zero3", "pp2"):
        assert _step_s(name, slow) == pytest.approx(_step_s(name, base))
    ops_f, ops_b = dtensor_ops(SMALL, LAYOUTS["tp2"], base)
    assert tp_linears_per_layer(SMALL) == 7 and (ops_f, ops_b) == (7 * 4.0, 7 * 9.0)
    # p = 1, no pipeline: every layer and both ends of every micro-batch pay their operators once
    per_micro_batch = SMALL.n_layers * (ops_f + ops_b) + 2 * (base.dtensor_ops_forward + base.dtensor_ops_backward)
    expected = LAYOUTS["tp2"].grad_accum_steps * per_micro_batch * cost
    assert _step_s("tp2", slow) - _step_s("tp2", base) == pytest.approx(expected, rel=1e-6)


def test_fsdp_call_overhead_moves_only_sharded_layouts():
    base = _cpu()
    slow = base.replace(fsdp_call_overhead_s=1e-3)
    for name in ("ddp", "tp2", "pp2"):
        assert _step_s(name, slow) == pytest.approx(_step_s(name, base))
    # ZeRO-3, per micro-batch: each layer gathers in the forward, gathers (the last one stays gathered:
    # 3 of 4 on average, rounded to 1 call) and reduce-scatters in the backward; of the root units the
    # embedding gathers twice and reduce-scatters, final norm + output gathers once and reduce-scatters
    calls = 2 * (SMALL.n_layers * 3 + 5)
    assert _step_s("zero3", slow) - _step_s("zero3", base) == pytest.approx(calls * 1e-3, rel=1e-6)


def test_alone_factors_follow_who_computes_beside_each_operation():
    # rank 0 busy 0-2, rank 1 busy 1-3: each computes alone half of its time
    ops = [Op(0, 0, 0, 0, 0.0, 2.0), Op(1, 0, 1, 0, 1.0, 3.0)]
    assert alone_factors(ops, 2, 2.0) == pytest.approx([0.75, 0.75])
    assert alone_factors(ops, 2, 1.0) == [1.0, 1.0]
    # two ranks per stage (pp 2 x dp 2): an idle stage frees 2 of the 3 other ranks
    assert alone_factors(ops, 2, 2.0, ranks_per_stage=2) == pytest.approx([1 - 0.5 * 0.5 * 2 / 3] * 2)


def test_solo_speedup_shortens_pipeline_steps_only():
    base = _cpu()
    solo = base.replace(solo_speedup=1.5)
    for name in ("ddp", "zero3", "tp2"):
        assert _step_s(name, solo) == pytest.approx(_step_s(name, base))
    shared, alone = _step_s("pp2", base), _step_s("pp2", solo)
    assert alone < shared
    # bounded by every operation at the solo rate (the optimizer and DP tail do not change)
    assert alone > shared / 1.5


def test_update_from_tp_lands_on_dtensor_not_on_ddps_compute():
    """A TP run whose only error is DTensor's host time: the fold moves the dtensor lever most, and the
    updated profile still predicts DDP (which has no DTensor) within a few percent."""
    base = _cpu().replace(dtensor_op_overhead_s=2e-4)  # about what calibrate measures on 2 CPU ranks
    truth = base.replace(dtensor_op_overhead_s=4e-4)
    new, info = fold_step(lambda p: _step_s("tp2", p), base, _step_s("tp2", truth))
    assert info["reached"]
    assert math.log(info["levers"]["dtensor"]) > 3 * abs(math.log(info["levers"].get("compute", 1.0)))
    assert abs(_step_s("ddp", new) / _step_s("ddp", truth) - 1) < 0.05
    assert "dtensor_op_overhead_s" in info["changed"] and "fields: " in describe(info)


def test_update_from_ddp_keeps_tp_and_fsdp_host_costs():
    base = _cpu().replace(dtensor_op_overhead_s=5e-5, fsdp_call_overhead_s=1e-3)
    truth = apply_levers(base, {"compute": 1.25})
    new, info = fold_step(lambda p: _step_s("ddp", p), base, _step_s("ddp", truth))
    assert new.dtensor_op_overhead_s == base.dtensor_op_overhead_s
    assert new.fsdp_call_overhead_s == base.fsdp_call_overhead_s
    assert info["levers"]["compute"] > 1.15
    # compute transfers: TP predicted from the DDP update is closer to the truth than before
    assert abs(math.log(_step_s("tp2", new) / _step_s("tp2", truth))) < \
        abs(math.log(_step_s("tp2", base) / _step_s("tp2", truth))) / 3


def test_dtensor_operators_are_counted_per_tp_linear_under_a_fake_group():
    """calibrate's count on the executor's TP block: only the split linears run on DTensors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executor.calibrate.blocks import count_dtensor_ops
    from executor.model import Block, rope_tables
    from executor.parallel.parallelize import block_tp_plan

    spec = ModelSpec(name="t", n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=128,
                     vocab=128, max_seq_len=16)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x, grad = torch.randn(1, 16, 64), torch.randn(1, 16, 64)
        cos, sin = rope_tables(16, 16, "cpu")
        assert count_dtensor_ops(Block(spec), x, grad, cos, sin) == (0, 0)
        block = Block(spec)
        from torch.distributed.tensor.parallel import PrepareModuleInput

        plan = block_tp_plan(block, False)
        linears = [k for k, v in plan.items() if not isinstance(v, PrepareModuleInput)]
        assert len(linears) == tp_linears_per_layer(spec)  # the planner's count of split linears
        parallelize_module(block, init_device_mesh("cpu", (2,)), plan)
        forward, backward = count_dtensor_ops(block, x, grad, cos, sin)
        assert forward > 0 and backward > forward
        # every split linear alike; beside them the backward adds the partial input gradients of q, k, v
        # (2 adds) and w1, w3 (1) as DTensors before each module's one all-reduce (PrepareModuleInput),
        # operators the host model does not price (3 of 66 here)
        adds = 3
        assert forward % len(linears) == 0 and (backward - adds) % len(linears) == 0
        _check_whole_model_count(spec, forward / len(linears), (backward - adds) / len(linears))
    finally:
        dist.destroy_process_group()


def test_bounds_stay_below_steps_priced_at_the_solo_speed():
    """The search's bounds price stages at the all-busy rate; with solo speed they divide it out for pipelines."""
    from planner.search.bound import StepBound
    from planner.simulate.step import compute_lower_bound_s

    cluster = load_cluster("cpu", 2)
    cal = _cpu().replace(solo_speedup=2.0, dtensor_op_overhead_s=2e-4, fsdp_call_overhead_s=1e-3)
    bound = StepBound(SMALL, cluster, cal, "meshplan")
    for name, layout in LAYOUTS.items():
        layout = with_stage_layers(SMALL, layout)
        step = simulate_step(SMALL, TRAINING, layout, cluster, cal).step_time_s
        assert bound.seconds(layout, TRAINING) <= step * (1 + 1e-9), name
        assert compute_lower_bound_s(SMALL, TRAINING, layout, cluster, cal) <= step, name


def _check_whole_model_count(spec: ModelSpec, per_linear_f: float, per_linear_b: float) -> None:
    """The executor's whole TP model (blocks, vocabulary-split embedding and output, loss_parallel)
    dispatches what the simulator prices: its layers' operators plus one split linear's at each end."""
    import dataclasses

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from executor.calibrate.blocks import dtensor_op_counter
    from executor.model import build_model, init_weights
    from executor.parallel.parallelize import apply_tp
    from executor.train import lm_loss
    from planner.simulate.host import end_host_s

    spec = dataclasses.replace(spec, n_layers=2)
    model = build_model(spec, "cpu")
    init_weights(model, spec, 0, torch.device("cpu"))
    apply_tp(model, init_device_mesh("cpu", (2,)), False, spec)
    tokens = torch.randint(0, spec.vocab, (1, 16))
    with loss_parallel():
        with dtensor_op_counter() as forward:
            loss = lm_loss(model(tokens), tokens)
        with dtensor_op_counter() as backward:
            loss.backward()
    cal = CalibrationProfile(dtensor_op_overhead_s=1.0, dtensor_ops_forward=per_linear_f,
                             dtensor_ops_backward=per_linear_b)
    layer_f, layer_b = dtensor_ops(spec, Layout(tp=2), cal)
    end_f, end_b = end_host_s(Layout(tp=2), cal)  # seconds at 1 s per operator: the operator count
    assert forward.count == pytest.approx(spec.n_layers * layer_f + 2 * end_f, rel=0.1)
    assert backward.count == pytest.approx(spec.n_layers * layer_b + 2 * end_b, rel=0.1)
