"""MoE time: all-to-all on the expert grid's real groups, expert tensor parallelism, MLA and MTP work,
the search's bound and its ep/etp pins, and the executor's refusal."""

from __future__ import annotations

import pytest

from planner.engines import executor_refusal
from planner.layout import Layout
from planner.model.load import load_model
from planner.search.bound import StepBound
from planner.search.candidates import Pins, expert_degrees
from planner.simulate.calibration import load_calibration
from planner.simulate.comm import StepComm, representative_expert_groups
from planner.simulate.compute import attention_gemms, gemm_flops, mlp_gemms, moe_times
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster

MIXTRAL = load_model("mixtral-8x7b")
T = TrainingSpec(seq_len=4096, global_batch_size=64, dtype="bf16")


def _step(model, layout, gpus, cluster="dgx-h100"):
    c = load_cluster(cluster, gpus)
    return simulate_step(model, T, layout, c, load_calibration(None, c.gpu), engine="megatron")


def test_all_to_all_inside_a_node_is_cheaper_than_across_nodes():
    # 16 GPUs, 2 nodes. etp = tp = 2: ep 4 groups are ranks 2 apart: 0, 2, 4, 6 (one node).
    inside = Layout(tp=2, dp_shard=8, zero_stage=1, ep=4, etp=2, sequence_parallel=True, grad_accum_steps=8)
    # etp 1: ep 16 spans both nodes.
    across = inside.replace(ep=8, etp=2, dp_shard=8)
    groups = representative_expert_groups(across.mesh_shape, 8, 2, "ep", 8)
    assert all(len({r // 8 for r in g}) == 2 for g in groups)
    assert all(len({r // 8 for r in g}) == 1 for g in representative_expert_groups(inside.mesh_shape, 4, 2, "ep", 8))
    a = _step(MIXTRAL, inside, 16).time_breakdown_s["ep_comm"]
    b = _step(MIXTRAL, across, 16).time_breakdown_s["ep_comm"]
    assert 0 < a < b


def test_all_to_all_efficiency_scales_the_dispatch():
    layout = Layout(tp=1, dp_shard=8, zero_stage=1, ep=8, grad_accum_steps=8)
    c = load_cluster("dgx-h100", 8)
    cal = load_calibration(None, c.gpu)
    full = StepComm(c, layout, cal.replace(all_to_all_efficiency=1.0)).ep_all_to_all_s(1e8)
    half = StepComm(c, layout, cal.replace(all_to_all_efficiency=0.5)).ep_all_to_all_s(1e8)
    assert half == pytest.approx(2 * full)


def test_all_to_all_across_the_network_takes_its_own_efficiency():
    cal = load_calibration(None, load_cluster("dgx-h100", 16).gpu).replace(all_to_all_efficiency=1.0)
    for gpus, crosses in ((8, False), (16, True)):  # ep = 8 in one node, ep = 16 over two
        c = load_cluster("dgx-h100", gpus)
        layout = Layout(tp=1, dp_shard=gpus, zero_stage=1, ep=gpus, grad_accum_steps=8)
        base = StepComm(c, layout, cal.replace(all_to_all_net_efficiency=1.0)).ep_all_to_all_s(1e8)
        slow = StepComm(c, layout, cal.replace(all_to_all_net_efficiency=0.25)).ep_all_to_all_s(1e8)
        assert slow == pytest.approx(4 * base if crosses else base)


def test_routed_experts_run_at_the_fp8_rate_under_fp8():
    c = load_cluster("dgx-h100", 8)
    cal = load_calibration(None, c.gpu)
    layout = Layout(tp=1, dp_shard=8, zero_stage=1, ep=8, grad_accum_steps=8)
    peak = c.gpu.peak_flops("bf16")
    bf16 = moe_times(MIXTRAL, 4096.0, 2, layout, peak, c.gpu, cal)
    fp8 = moe_times(MIXTRAL, 4096.0, 2, layout, peak, c.gpu, cal, fp8_peak=c.gpu.peak_flops("fp8"))
    neutral = moe_times(MIXTRAL, 4096.0, 2, layout, peak, c.gpu, cal.replace(fp8_expert_efficiency=1.0),
                        fp8_peak=c.gpu.peak_flops("fp8"))
    assert neutral[0] < 0.75 * bf16[0]  # twice the peak at a comparable share of it
    assert fp8[0] == pytest.approx(neutral[0] / cal.fp8_expert_efficiency)
    assert bf16[2] == bf16[3] == 0.0 and fp8[2] > 0 and fp8[3] > 0  # and the operand casts


def test_grouped_gemm_efficiency_applies_to_several_experts_per_rank_only():
    c = load_cluster("dgx-h100", 8)
    cal = load_calibration(None, c.gpu).replace(moe_imbalance=1.0)
    peak = c.gpu.peak_flops("bf16")

    def expert_s(ep, efficiency):
        layout = Layout(tp=1, dp_shard=8, zero_stage=1, ep=ep, grad_accum_steps=8)
        return moe_times(MIXTRAL, 4096.0, 2, layout, peak, c.gpu, cal.replace(grouped_gemm_efficiency=efficiency))[0]

    assert expert_s(8, 0.5) == pytest.approx(expert_s(8, 1.0))  # one expert per rank: a plain GEMM
    assert expert_s(2, 0.5) == pytest.approx(2 * expert_s(2, 1.0))  # four experts per rank


def test_expert_flops_do_not_depend_on_the_expert_grid():
    m = 4096.0
    base = Layout(tp=2, dp_shard=8, zero_stage=1, sequence_parallel=True)
    flops = {(ep, etp): gemm_flops(tuple(mlp_gemms(MIXTRAL, m, base.replace(ep=ep, etp=etp))[1]))
             for ep, etp in ((1, 1), (8, 1), (4, 2), (2, 2))}
    # balanced routing: every rank runs m/tp tokens x top_k through experts of full width, however split
    expected = 2 * m / 2 * MIXTRAL.moe.top_k * 3 * MIXTRAL.hidden * MIXTRAL.moe.expert_ffn_hidden
    assert all(f == pytest.approx(expected) for f in flops.values())


def test_mla_projection_flops_match_its_parameters():
    ds = load_model("deepseek-v3")
    m = 1000.0
    # every attention weight but the two latent norms takes part in one GEMM per token
    weights = ds.attention_params - ds.mla.q_lora_rank - ds.mla.kv_lora_rank
    assert gemm_flops(tuple(attention_gemms(ds, m, 1))) == pytest.approx(2 * m * weights)


def test_mtp_and_dense_layers_add_time_on_their_stages():
    ds = load_model("deepseek-v3")
    no_mtp = ds.__class__.from_json({**ds.to_json(), "mtp_layers": 0})
    layout = Layout(tp=8, pp=8, dp_shard=4, zero_stage=1, ep=32, sequence_parallel=True, grad_accum_steps=16)
    with_mtp, without = _step(ds, layout, 256), _step(no_mtp, layout, 256)
    assert with_mtp.step_time_s > without.step_time_s


def test_bound_stays_below_simulated_moe_steps():
    c = load_cluster("dgx-h100", 64)
    cal = load_calibration(None, c.gpu)
    bound = StepBound(MIXTRAL, c, cal, "megatron")
    t = TrainingSpec(seq_len=4096, global_batch_size=128, dtype="bf16")
    for ep, etp, tp, zero in ((8, 1, 2, 1), (4, 2, 2, 1), (8, 2, 4, 2), (2, 4, 4, 3)):
        dp = 64 // tp
        layout = Layout(tp=tp, dp_shard=dp, zero_stage=zero, ep=ep, etp=etp, sequence_parallel=True,
                        grad_accum_steps=128 // dp)
        sim = simulate_step(MIXTRAL, t, layout, c, cal, engine="megatron").step_time_s
        assert bound.seconds(layout, t) <= sim * (1 + 1e-9)


def test_search_pins_and_degrees():
    assert expert_degrees(MIXTRAL, 8, 1, 2) == ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (8, 2))
    assert expert_degrees(MIXTRAL, 8, 1, 2, 8, 1) == ((8, 1),)
    assert expert_degrees(load_model("debug"), 8, 1, 2) == ((1, 1),)
    kimi = load_model("kimi-k2")
    # powers of two among 384's divisors (3, 6, 12, ... left out) that divide 1024 ranks
    assert {ep for ep, _ in expert_degrees(kimi, 1024, 1, 1)} == {1, 2, 4, 8, 16, 32, 64, 128}
    assert 384 in {ep for ep, _ in expert_degrees(kimi, 768, 1, 1)}
    Pins(ep=8, etp=2)  # accepted


def test_executor_refusal_names_the_engines_that_can():
    assert executor_refusal(MIXTRAL, Layout(), "bf16", on_gpu=False) is None  # top-k MoE runs (executor.moe)
    why = executor_refusal(load_model("deepseek-v3"), Layout(), "bf16", on_gpu=False)  # MLA, MTP: not built
    assert "--engine megatron" in why and "--engine deepspeed" in why


@pytest.mark.parametrize("shape, ep, etp", [((2, 1, 4, 1, 2), 8, 1), ((2, 2, 4, 2, 2), 4, 2), ((3, 1, 6, 1, 4), 3, 4),
                                            ((1, 3, 4, 1, 1), 2, 1), ((2, 1, 2, 3, 2), 3, 2)])
def test_representative_expert_groups_cover_every_placement(shape, ep, etp):
    from planner.layout import expert_groups

    def placement(group, g):
        counts = {}
        for r in group:
            counts[r // g] = counts.get(r // g, 0) + 1
        return tuple(sorted(counts.values()))

    for g in (4, 8):
        for kind in ("ep", "etp"):
            every = {placement(grp, g) for grp in expert_groups(shape, ep, etp, kind)}
            reps = representative_expert_groups(shape, ep, etp, kind, g)
            assert {placement(grp, g) for grp in reps} == every
            assert set(reps) <= set(expert_groups(shape, ep, etp, kind))


def test_a2a_overlap_hides_the_expert_all_to_alls_under_the_other_pass():
    """--overlap-moe-expert-parallel-comm: exposed EP time shrinks and the step with it."""
    cluster = load_cluster("dgx-h100", 32)
    layout = Layout(pp=1, dp_shard=32, zero_stage=1, ep=32, grad_accum_steps=2)
    training = TrainingSpec(seq_len=2048, global_batch_size=64, precision="bf16")
    cal = load_calibration(None, cluster.gpu)
    plain = simulate_step(MIXTRAL, training, layout, cluster, cal, engine="megatron")
    hidden = simulate_step(MIXTRAL, training.replace(moe_a2a_overlap=True), layout, cluster, cal, engine="megatron")
    assert plain.time_breakdown_s["ep_comm"] > 0
    assert hidden.time_breakdown_s["ep_comm"] < plain.time_breakdown_s["ep_comm"]
    assert hidden.step_time_s < plain.step_time_s
    bound = StepBound(MIXTRAL, cluster, cal, "megatron")
    overlapped = training.replace(moe_a2a_overlap=True)
    assert bound.seconds(layout, overlapped) <= hidden.step_time_s * (1 + 1e-9)
