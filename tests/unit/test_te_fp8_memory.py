"""Megatron-Core + Transformer Engine memory under fp8: what each rule counts, read from their sources.

planner.engines.registry (TE_FP8) and planner.memory.activations say where each
figure comes from: TE's te.Linear / FusedAttnFunc saved tensors, its
parallel_cross_entropy, Megatron-Core's interleaved schedule and
--fp8-param-gather.
"""

from __future__ import annotations

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.memory.activations import layer_activation_terms
from planner.memory.estimate import estimate_memory
from planner.memory.in_flight import output_in_flight
from planner.model.load import load_model
from planner.training import TrainingSpec, training_for
from topologies.errors import PlanError
from topologies.hardware import get_gpu

LLAMA70 = load_model("llama3-70b")
GIB = 2**30


def test_the_output_projection_keeps_its_own_8bit_input_beside_the_attention_output():
    s, b, t = 8192, 1, 4
    common = dict(sequence_parallel=True, dtype_bytes=2, fused_swiglu=True)
    bf16 = layer_activation_terms(LLAMA70, s, b, t, **common)
    fp8 = layer_activation_terms(LLAMA70, s, b, t, fp8_inputs=True, **common)
    assert "proj_fp8_input" not in bf16
    assert fp8["proj_input"] == bf16["proj_input"]  # the fused attention's own D-byte output
    assert fp8["proj_fp8_input"] == pytest.approx(bf16["proj_input"] / 2)


def test_te_cross_entropy_keeps_only_the_compute_dtype_logits():
    layout = Layout(tp=2, pp=1, dp_shard=4, zero_stage=1, micro_batch_size=1, sequence_parallel=True)
    gpu = get_gpu("b200")
    plain = estimate_memory(LLAMA70, training_for(8192, 64, "fp8"), layout, gpu, "megatron").activations
    fused = estimate_memory(LLAMA70, training_for(8192, 64, "fp8", fused_cross_entropy=True), layout, gpu,
                            "megatron").activations
    logits = 8192 * LLAMA70.vocab / 2  # local logits of one micro-batch
    assert plain.logits_saved == pytest.approx(4 * logits)  # fp32 copy, then its gradient in place
    assert plain.logits_grad == pytest.approx(2 * logits)
    assert (fused.logits_saved, fused.logits_grad, fused.loss_transient) == (pytest.approx(2 * logits), 0.0, 0.0)
    # torchtitan fuses its loss only by compiling it with the blocks: not without compile
    reason = get_engine("torchtitan").refusal(LLAMA70, layout.replace(zero_stage=3), "bf16", True,
                                              training_for(8192, 64, "bf16", fused_cross_entropy=True))
    assert "fused_cross_entropy" in reason


def test_interleaved_last_stage_holds_one_microbatch_of_logits():
    """Megatron's interleaved 1F1B runs the last chunk's backward right after its forward on the last rank."""
    assert output_in_flight("interleaved-1f1b", 8) == 1.0
    assert output_in_flight("1f1b", 8) == 0.0 and output_in_flight("gpipe", 8) == 0.0
    layout = Layout(tp=8, pp=4, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=16,
                    sequence_parallel=True, pp_schedule="interleaved-1f1b", virtual_stages=4)
    est = estimate_memory(LLAMA70, training_for(4096, 32, "bf16"), layout, get_gpu("h100-sxm"), "megatron")
    acts = est.activations
    last = est.per_stage[-1]["activations"]
    sb, sp, in_flight = est.stages[-1]
    assert in_flight > 1
    layers = in_flight * sp.layers * acts.per_layer
    assert last == pytest.approx(layers + acts.output + acts.logits_saved + acts.loss_transient, rel=1e-6)


def test_fp8_params_need_an_8bit_precision_and_an_engine_that_keeps_them():
    with pytest.raises(PlanError, match="fp8_params"):
        TrainingSpec(seq_len=4096, global_batch_size=8, fp8_params=True)
    training = training_for(4096, 8, "fp8", fp8_params=True)
    assert TrainingSpec.from_json(training.to_json()) == training
    assert "fp8_params" not in training_for(4096, 8, "fp8").to_json()  # optional key, old plans load
    assert get_engine("megatron").refusal(LLAMA70, Layout(dp_shard=8, zero_stage=1), "bf16", True, training) is None
    assert "fp8_params" in get_engine("torchtitan").refusal(LLAMA70, Layout(dp_shard=8, zero_stage=3), "bf16",
                                                             True, training)


def test_megatron_fsdp_shards_and_gathers_8bit_parameters():
    """Megatron FSDP with 8-bit parameters: uint8 shards and 1-byte gathered blocks instead of bf16."""
    layout = Layout(dp_shard=64, zero_stage=3, micro_batch_size=1)
    gpu = get_gpu("gb200")
    plain, primary = (estimate_memory(LLAMA70, training_for(8192, 64, "fp8", fp8_params=p), layout, gpu,
                                      "megatron").per_stage[0] for p in (False, True))
    block = (LLAMA70.total_params - 2 * LLAMA70.vocab * LLAMA70.hidden) / LLAMA70.n_layers
    assert plain["params"] - primary["params"] == pytest.approx(block * LLAMA70.n_layers / 64, rel=0.02)
    assert plain["comm_buffers"] - primary["comm_buffers"] == pytest.approx(2 * block, rel=0.02)
