"""The executor's fp8 path with torchao's float8 (executor.components.float8), on meta and fake tensors.

torchao is not a dependency of meshplan; it is installed in .venv-consumers
(`make test-consumers`, the `consumers` extra pins torchao==0.18.0 beside
torch 2.13), so these tests live here and import it unconditionally. No GPU:
the conversion runs on the meta device, and a whole FSDP2 step (float8
all-gather, the post-optimizer scale precompute) runs under a fake process
group and FakeTensorMode through the validate-memory harness.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from executor.components.float8 import convert
from executor.model import build_model
from planner.layout import Layout
from planner.model.load import load_model
from planner.model.spec import ModelSpec
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster

TINY = ModelSpec(name="tiny", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64,
                 ffn_hidden=688, vocab=4096, max_seq_len=512)


def test_blocks_linears_become_float8_and_the_output_layer_does_not():
    model = build_model(TINY, "meta")
    converted = convert(model, fsdp_float8_all_gather=True)
    assert converted == 7 * TINY.n_layers  # wq wk wv wo w1 w2 w3 per block
    assert type(model.output) is nn.Linear  # torchtitan's filter_fqns: the vocabulary GEMM stays bf16
    block = model.layers["0"]
    assert isinstance(block.attention.wq, Float8Linear) and isinstance(block.feed_forward.w2, Float8Linear)
    assert block.attention.wq.config.cast_config_weight is not None
    assert block.attention.wq.config.enable_fsdp_float8_all_gather


def test_dims_not_divisible_by_16_stay_high_precision():
    odd = dataclasses.replace(load_model("debug"), ffn_hidden=100)  # w1, w3 (100 x 64) and w2 (64 x 100)
    model = build_model(odd, "meta")
    assert convert(model, fsdp_float8_all_gather=False) == 4 * odd.n_layers  # attention only
    assert type(model.layers["0"].feed_forward.w1) is nn.Linear


def _plan(precision: str, recompute: str = "none") -> Plan:
    layout = with_stage_layers(TINY, Layout(micro_batch_size=2, dp_shard=8, zero_stage=3, recompute=recompute))
    return Plan(model=TINY, cluster=load_cluster("dgx-h100", 8), layout=layout,
                training=TrainingSpec(seq_len=512, global_batch_size=16, precision=precision))


@pytest.mark.parametrize("recompute", ["none", "op"])
def test_fsdp_step_gathers_float8_weights_and_matches_the_memory_model(recompute):
    """The executor's own parallelize + step for an fp8 FSDP plan, tracked by PyTorch's FSDPMemTracker:
    the gathered block weights shrink (one byte per float8 weight) and the prediction stays within 5%
    (per-op SAC: the float8 GEMMs, torch._scaled_mm, saved every second one like mm)."""
    from executor.validate.memory_step import tracked_peak
    from planner.memory.estimate import estimate_memory

    bf16, fp8 = (tracked_peak(_plan(p, recompute), 0) for p in ("bf16", "fp8"))
    block_linears = 2 * TINY.hidden * TINY.q_dim + 2 * TINY.hidden * TINY.kv_dim + 3 * TINY.hidden * TINY.ffn_hidden
    # at the peak (the loss backward) the last block is gathered (not resharded after forward), now in float8:
    # one byte less per linear weight; the head unit (output layer) stays bf16
    assert bf16["Unsharded Param"] - fp8["Unsharded Param"] == pytest.approx(block_linears, rel=0.01)
    plan = _plan("fp8", recompute)
    predicted = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
    assert abs(predicted.allocated_bytes / fp8["Total"] - 1) <= 0.05
