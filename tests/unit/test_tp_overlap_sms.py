"""The SMs Transformer Engine's userbuffers collectives take from their GEMMs (planner.simulate.tp_overlap.sm_share_s)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.engines import NO_SMS, TE_UB_DEFAULT, CommSms, TpOverlapSms, get_engine
from planner.layout import Layout
from planner.model.load import load_model
from planner.simulate.calibration import load_calibration
from planner.simulate.compute import tokens_per_micro_batch
from planner.simulate.step import simulate_step
from planner.simulate.tp_overlap import OverlapGemms, overlap_gemms, sm_share_s
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError, TopologyError
from topologies.hardware import GPUS, GPUSpec

GEMMS = OverlapGemms(gather_s=(3e-3, 6e-3), scatter_s=(1e-3, 4e-3), chunking_s=0.0)


def _only(field: str, claim: CommSms, point: int) -> TpOverlapSms:
    """NO_SMS but for one collective."""
    claims = list(getattr(NO_SMS, field))
    claims[point] = claim
    return dataclasses.replace(NO_SMS, **{field: tuple(claims)})


def test_a_gemm_with_an_sm_margin_runs_on_the_other_sms_throughout():
    fwd, dgrad, wgrad = sm_share_s(GEMMS, _only("fprop_rs", CommSms(24, True), 1), 132, 1e-3, 2e-3)
    assert (dgrad, wgrad) == (0.0, 0.0)
    assert fwd == pytest.approx(4e-3 * 132 / 108 - 4e-3)  # 132/108 times as long


def test_a_shared_gemm_loses_the_sms_only_while_the_collective_runs():
    # the bulk reduce-scatter under the attention point's weight-gradient GEMM (3 ms): 2 ms of 16 SMs
    _, _, wgrad = sm_share_s(GEMMS, _only("wgrad_rs", CommSms(16, False), 0), 132, 1e-3, 2e-3)
    assert wgrad == pytest.approx(2e-3 * 16 / 132)
    # a collective longer than its GEMM holds the SMs for the GEMM's time only
    _, dgrad, _ = sm_share_s(GEMMS, _only("dgrad_ag", CommSms(16, False), 0), 132, 9e-3, 2e-3)
    assert dgrad == pytest.approx(3e-3 * 16 / 132)


def test_no_sms_or_an_uncatalogued_gpu_costs_nothing():
    assert sm_share_s(GEMMS, NO_SMS, 132, 1e-3, 1e-3) == (0.0, 0.0, 0.0)
    assert sm_share_s(GEMMS, TE_UB_DEFAULT, 0, 1e-3, 1e-3) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="132"):
        sm_share_s(GEMMS, _only("fprop_rs", CommSms(132, True), 0), 132, 1e-3, 1e-3)


def test_claims_and_sm_counts_are_validated():
    with pytest.raises(PlanError, match="sms"):
        CommSms(-1, True)
    with pytest.raises(TopologyError, match="sm_count"):
        dataclasses.replace(GPUS["h100-sxm"], sm_count=-4)
    assert all(g.sm_count > 0 for g in GPUS.values() if g.kind == "gpu")
    assert GPUSpec.from_json({k: v for k, v in GPUS["h100-sxm"].to_json().items() if k != "sm_count"}).sm_count == 0


def test_megatron_async_tp_pays_te_defaults_and_torchtitan_none():
    """Megatron's async TP is TE userbuffers (16 SMs for pipeline and bulk overlaps by default); the step
    grows by exactly the SM share of its overlapped GEMMs, torchtitan's copy-engine chunks take none."""
    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100", 16)
    layout = Layout(tp=8, dp_shard=2, zero_stage=1, sequence_parallel=True, micro_batch_size=1, grad_accum_steps=4)
    training = TrainingSpec(seq_len=4096, global_batch_size=8, async_tp=True)
    megatron = get_engine("megatron")
    assert megatron.tp_overlap_sms(training) == TE_UB_DEFAULT
    assert get_engine("torchtitan").tp_overlap_sms(training) == NO_SMS
    priced = simulate_step(model, training, layout, cluster, engine=megatron)
    free = simulate_step(model, training, layout, cluster,
                         engine=dataclasses.replace(megatron, tp_overlap_default=NO_SMS))
    assert priced.time_breakdown_s["compute"] > free.time_breakdown_s["compute"]
    cal = load_calibration(None, cluster.gpu).for_engine("megatron")
    gemms = overlap_gemms(model, tokens_per_micro_batch(training.seq_len, layout), layout,
                          cluster.gpu.peak_flops("bf16"), cal)
    margin = 16 / (cluster.gpu.sm_count - 16)  # every TE default claim with SMs has a margin
    per_layer = margin * (sum(gemms.scatter_s) + 2 * sum(gemms.gather_s))
    grown = priced.time_breakdown_s["compute"] - free.time_breakdown_s["compute"]
    assert grown == pytest.approx(per_layer * model.n_layers * layout.grad_accum_steps, rel=0.02)
