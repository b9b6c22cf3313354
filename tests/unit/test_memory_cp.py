"""Context parallelism in the memory model: what each engine's attention keeps per rank, and its buffers.

Transformer Engine (Megatron-Core) and torch's context_parallel (torchtitan)
save only the local Q, K, V, output and softmax statistics for the backward
(planner.memory.activations docstring), so without recomputation a rank's
activations are the cp = 1 ones divided by cp. What differs is the K/V in
flight: TE's ring holds the chunk sent and the one received; torch's default
all-gather rotater (and meshplan's executor) holds the whole sequence's K/V.
"""

from __future__ import annotations

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.memory.estimate import _activation_comm, estimate_memory
from planner.memory.phases import step_phases
from planner.model.load import load_model
from planner.training import TrainingSpec
from topologies.hardware import get_gpu

MODEL = load_model("70B")
SEQ = 32768


def _layout(cp: int, **kw) -> Layout:
    return Layout(cp=cp, dp_shard=2, zero_stage=kw.pop("zero_stage", 3 if "tp" not in kw else 1),
                  micro_batch_size=1, grad_accum_steps=4, **kw)


@pytest.mark.parametrize("engine,extra", [("megatron", dict(tp=8, sequence_parallel=True)),
                                          ("torchtitan", dict(tp=8, sequence_parallel=True)),
                                          ("torchtitan", {})])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fused_attention_keeps_the_local_share_under_cp(engine, extra, recompute):
    training = TrainingSpec(seq_len=SEQ, global_batch_size=8, attention="fused")
    gpu = get_gpu("h100-sxm")
    base = estimate_memory(MODEL, training, _layout(1, recompute=recompute, **extra), gpu, engine).activations
    for cp in (2, 4, 8):
        acts = estimate_memory(MODEL, training, _layout(cp, recompute=recompute, **extra), gpu, engine).activations
        assert acts.per_layer == pytest.approx(base.per_layer / cp, rel=1e-9)
        assert acts.recomputed == pytest.approx(base.recomputed / cp, rel=1e-9)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_kv_in_flight_ring_against_all_gather(cp):
    training = TrainingSpec(seq_len=SEQ, global_batch_size=8, attention="fused")
    layout = _layout(cp)  # no tp, pp or ep: the CP buffer is the only activation buffer
    local_kv = 2 * SEQ / cp * MODEL.kv_dim * training.dtype_bytes
    # (the CP part, the rest)
    # TE p2p: send + receive; meshplan's executor: the whole sequence
    assert _activation_comm(MODEL, training, layout, get_engine("megatron")) == (int(2 * local_kv), 0)
    assert _activation_comm(MODEL, training, layout, get_engine("meshplan")) == (int(cp * local_kv), 0)
    # torchtitan's Attention repeated the K/V heads to the query heads before SDPA: the gather moved those
    assert MODEL.q_dim > MODEL.kv_dim
    titan_2025 = _activation_comm(MODEL, training, layout, get_engine("torchtitan@2025-06"))
    assert titan_2025 == (int(cp * local_kv * MODEL.q_dim / MODEL.kv_dim), 0)
    # ... until ff0829c10 (2026-01-27, in torchtitan@2026-02): SDPA takes GQA's K/V as they are
    assert _activation_comm(MODEL, training, layout, get_engine("torchtitan@2026-02")) == (int(cp * local_kv), 0)


def test_cp_exchange_buffers_only_while_a_block_runs():
    # the gathered K/V exists during a block's attention: in block_backward, not at the loss backward
    training = TrainingSpec(seq_len=SEQ, global_batch_size=8, attention="fused")
    gpu = get_gpu("h100-sxm")
    with_cp = estimate_memory(MODEL, training, _layout(4), gpu, "torchtitan@2025-06")
    cp_bytes, _ = _activation_comm(MODEL, training, _layout(4), get_engine("torchtitan@2025-06"))
    assert cp_bytes > 0
    for sb, _, _ in with_cp.stages:
        assert sb.attention_comm == cp_bytes and sb.comm == 0
    sb, sp, in_flight = with_cp.stages[0]
    phases = step_phases(sb, sp, with_cp.activations, in_flight)
    without = step_phases(sb._replace(attention_comm=0), sp, with_cp.activations, in_flight)
    assert phases["backward_start"] == without["backward_start"]
    assert phases["output_backward"] == without["output_backward"]
    assert sum(phases["block_backward"]) - sum(without["block_backward"]) == cp_bytes
    # the papers' accounting (megatron) keeps every buffer at once
    published = estimate_memory(MODEL, training, _layout(4), gpu, "megatron")
    megatron_cp = _activation_comm(MODEL, training, _layout(4), get_engine("megatron"))[0]
    assert all(sb.comm == megatron_cp for sb, _, _ in published.stages)


def test_eager_attention_with_cp_is_refused_where_the_engine_has_no_such_kernel():
    eager = TrainingSpec(seq_len=SEQ, global_batch_size=8, attention="eager")
    layout = _layout(2)
    for engine in ("megatron", "torchtitan"):
        reason = get_engine(engine).refusal(MODEL, layout, "bf16", True, eager)
        assert reason is not None and "--attention fused" in reason and "cp 2" in reason
        assert get_engine(engine).refusal(MODEL, _layout(1), "bf16", True, eager) is None
    # DeepSpeed's pipeline releases modelled predate DeepSpeed-Ulysses: no context parallelism at all
    assert "no context parallelism" in get_engine("deepspeed").refusal(
        MODEL, Layout(cp=2, dp_replicate=2, grad_accum_steps=4), "bf16", True, eager)


def test_meshplans_executor_saves_the_gathered_kv():
    """executor.parallel.context all-gathers K/V outside the attention kernel and repeats GQA's heads to the
    query heads, so autograd keeps the whole sequence's K/V at the query width (s*b*q_dim each, beyond the
    local s*b/cp*kv_dim), unless the block is recomputed."""
    training = TrainingSpec(seq_len=SEQ, global_batch_size=8, attention="fused")
    gpu, cp = get_gpu("h100-sxm"), 4
    gathered = 2 * SEQ * (MODEL.q_dim - MODEL.kv_dim / cp) * training.dtype_bytes
    for recompute, extra in (("none", gathered), ("full", 0.0)):
        mine = estimate_memory(MODEL, training, _layout(cp, recompute=recompute), gpu, "meshplan").activations
        titan = estimate_memory(MODEL, training, _layout(cp, recompute=recompute), gpu, "torchtitan").activations
        assert mine.per_layer - titan.per_layer == pytest.approx(extra)
