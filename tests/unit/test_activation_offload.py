"""Activation offload (Layout.activation_offload_layers): Megatron-Core's cpu_offloading_num_layers.

Transformer Engine's CPU offload context moves the saved tensors of N layers
to host memory after their forward and brings each back ahead of its
backward; the GPU keeps the other layers' (planner.memory.estimate).
Sharded parameters (Megatron FSDP) keep no persistent 8-bit weight copies
(planner.memory.states); Megatron-Core's loss backward works in place on its
saved fp32 softmax (mechanisms.Loss "megatron").
"""

from __future__ import annotations

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.model.load import load_model
from planner.training import TrainingSpec
from topologies.errors import PlanError
from topologies.hardware import get_gpu

B200 = get_gpu("b200")
H200 = get_gpu("h200")
FSDP = Layout(dp_shard=64, zero_stage=3, micro_batch_size=2, grad_accum_steps=2)
TRAINING = TrainingSpec(seq_len=8192, global_batch_size=256, precision="fp8", grad_dtype="bf16")


@pytest.fixture(scope="module")
def llama70b():
    return load_model("llama3-70b")


def test_offloaded_layers_leave_the_gpu_for_the_host(llama70b):
    base = estimate_memory(llama70b, TRAINING, FSDP, B200, "megatron")
    for n in (5, 40):
        off = estimate_memory(llama70b, TRAINING, FSDP.replace(activation_offload_layers=n), B200, "megatron")
        per_layer = base.activations.per_layer
        assert base.peak_bytes - off.peak_bytes == pytest.approx(n * per_layer, rel=1e-6)
        assert off.host_bytes - base.host_bytes == pytest.approx(n * per_layer, rel=1e-6)
    # the layer whose backward runs first never leaves: asking for all of them keeps one
    every = estimate_memory(llama70b, TRAINING, FSDP.replace(activation_offload_layers=500), B200, "megatron")
    assert every.host_bytes == pytest.approx((llama70b.n_layers - 1) * base.activations.per_layer, rel=1e-6)


def test_only_megatron_offloads_activations(llama70b):
    layout = FSDP.replace(activation_offload_layers=4)
    assert get_engine("megatron").refusal(llama70b, layout, "bf16", True, TRAINING) is None
    for engine in ("torchtitan", "meshplan", "deepspeed"):
        why = get_engine(engine).refusal(llama70b, layout, "bf16", True, TRAINING)
        assert why and "activation_offload_layers" in why


def test_layout_key_is_optional_and_checked():
    old = Layout(dp_shard=2, zero_stage=1).to_json()
    old.pop("activation_offload_layers")
    assert Layout.from_json(old).activation_offload_layers == 0  # plans written before the key
    again = Layout(dp_shard=2, zero_stage=3, activation_offload_layers=3)
    assert Layout.from_json(again.to_json()) == again
    for bad in (-1, True, 1.5):
        with pytest.raises(PlanError, match="activation_offload_layers"):
            Layout(activation_offload_layers=bad)


def test_sharded_parameters_keep_no_fp8_weight_copies(llama70b):
    """Megatron FSDP gathers a unit at a time: no stage-wide 8-bit copy (its keep_fp8_transpose_cache is off)."""
    bf16 = TrainingSpec(seq_len=8192, global_batch_size=256, grad_dtype="bf16")
    fsdp = [estimate_memory(llama70b, t, FSDP, B200, "megatron").breakdown_bytes["params"] for t in (bf16, TRAINING)]
    assert fsdp[0] == fsdp[1]
    zero1 = Layout(tp=8, dp_shard=8, zero_stage=1, grad_accum_steps=4)
    dense = [estimate_memory(llama70b, t, zero1, B200, "megatron").breakdown_bytes["params"] for t in (bf16, TRAINING)]
    assert dense[1] - dense[0] > 0.4 * dense[0]  # an 8-bit copy of the blocks beside the 2-byte weights


def test_megatron_loss_backward_is_in_place(llama70b):
    acts = estimate_memory(llama70b, TRAINING, FSDP, B200, "megatron").activations
    assert acts.loss_transient == pytest.approx(acts.logits_saved / 2)  # the bf16 gradient only, 2 of 4 B
    titan = estimate_memory(llama70b, TRAINING, FSDP.replace(recompute="op"), B200, "torchtitan").activations
    assert titan.loss_transient == pytest.approx(2 * titan.logits_saved)  # PyTorch's log_softmax backward
