"""Activation memory against Korthikanti et al. 2022, term by term, and its schedule rules.

Reference: V. Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023, arXiv:2205.05198), section 4.1-4.2 and
table 2: bytes per layer with 16-bit activations and 1-byte dropout masks.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.memory.activations import (
    layer_activation_bytes,
    layer_activation_terms,
    output_activation_bytes,
)
from planner.memory.in_flight import in_flight_microbatches
from planner.model.load import load_model

# GPT-3 175B (Korthikanti's table 3 model) with dropout on, as the paper assumes.
GPT = dataclasses.replace(load_model("gpt3-175b"), dropout=0.1)
S, B = 2048, 1
H, A = GPT.hidden, GPT.n_heads
SBH = S * B * H


def _terms(**kw):
    base = dict(seq_len=S, micro_batch=B, dtype_bytes=2, fused_attention=False)
    return layer_activation_terms(GPT, **{**base, **kw})


def test_no_parallelism_is_34_plus_5as_over_h():
    total, _ = layer_activation_bytes(_terms(), "none")
    assert total == pytest.approx(SBH * (34 + 5 * A * S / H))


def test_attention_mlp_and_norm_groups_match_section_4_1():
    t = _terms()
    # attention block: 11sbh + 5as^2b
    attention = (t["qkv_input"] + t["q_k"] + t["v"] + t["proj_input"] + t["attn_dropout_mask"]
                 + t["core_softmax"] + t["core_dropout_mask"] + t["core_dropout_output"])
    assert attention == pytest.approx(11 * SBH + 5 * A * S * S * B)
    assert t["q_k"] == pytest.approx(4 * SBH)  # Q and K
    assert t["core_softmax"] == pytest.approx(2 * A * S * S * B)
    assert t["core_dropout_mask"] == pytest.approx(A * S * S * B)
    # MLP: 2sbh input + 8sbh GeLU input + 8sbh GeLU output + sbh dropout mask = 19sbh
    assert t["mlp_input"] + t["mlp_inner"] + t["mlp_dropout_mask"] == pytest.approx(19 * SBH)
    # two layer norms: 4sbh
    assert t["norm1_input"] + t["norm2_input"] == pytest.approx(4 * SBH)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_is_10_plus_24_over_t(tp):
    total, _ = layer_activation_bytes(_terms(tp=tp), "none")
    assert total == pytest.approx(SBH * (10 + 24 / tp + 5 * A * S / (H * tp)))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_and_sequence_parallel_is_34_over_t(tp):
    total, _ = layer_activation_bytes(_terms(tp=tp, sequence_parallel=True), "none")
    assert total == pytest.approx(SBH * (34 / tp + 5 * A * S / (H * tp)))


@pytest.mark.parametrize("tp", [1, 8])
def test_selective_recompute_keeps_34_over_t(tp):
    kept, transient = layer_activation_bytes(_terms(tp=tp, sequence_parallel=tp > 1), "selective")
    assert kept == pytest.approx(SBH * 34 / tp)
    assert transient == pytest.approx(SBH * 5 * A * S / (H * tp))  # one layer's scores, recomputed


def test_full_recompute_keeps_2sbh_per_layer():
    kept, _ = layer_activation_bytes(_terms(), "full")
    assert kept == pytest.approx(2 * SBH)
    kept_sp, _ = layer_activation_bytes(_terms(tp=8, sequence_parallel=True), "full")
    assert kept_sp == pytest.approx(2 * SBH / 8)


def test_output_layer_matches_section_4_3():
    # final layernorm + output-layer inputs 4sbh/t, fp32 logits 4sbv/t (Korthikanti's total 4sbh/t (1 + v/h))
    saved, logits_saved, transient = output_activation_bytes(GPT, S, B, 8, 1, sequence_parallel=True, dtype_bytes=2)
    assert saved + logits_saved == pytest.approx(4 * SBH / 8 * (1 + GPT.vocab / H))
    assert transient == pytest.approx(2 * logits_saved)


def test_fused_loss_parallel_backward_holds_12_bytes_per_local_logit():
    # torch's loss_parallel (torchtitan under TP): 4 B saved, three fp32 tensors in its fused backward
    kw = dict(sequence_parallel=True, dtype_bytes=2, fused_loss_parallel_backward=True)
    saved, logits_saved, transient = output_activation_bytes(GPT, S, B, 8, 1, **kw)
    assert logits_saved == pytest.approx(4 * S * B * GPT.vocab / 8)
    assert transient == pytest.approx(3 * logits_saved)
    # without TP there is no DTensor: aten's unfused backward, 8 B
    _, logits_saved1, transient1 = output_activation_bytes(GPT, S, B, 1, 1, **kw)
    assert transient1 == pytest.approx(2 * logits_saved1)


def test_fused_attention_drops_s_squared_and_keeps_lse():
    eager = _terms()
    fused = _terms(fused_attention=True)
    assert set(k for k in fused if k.startswith("core_")) == {"core_logsumexp"}
    assert fused["core_logsumexp"] == pytest.approx(4 * A * S * B)
    assert sum(eager.values()) - sum(fused.values()) == pytest.approx(5 * A * S * S * B - 4 * A * S * B)


def test_gqa_shrinks_k_and_v():
    llama = load_model("llama3-8b")  # 32 query heads, 8 KV heads, head_dim 128
    mha = dataclasses.replace(llama, n_kv_heads=llama.n_heads)
    gqa_t = layer_activation_terms(llama, 4096, 1)
    mha_t = layer_activation_terms(mha, 4096, 1)
    tokens = 4096
    assert gqa_t["v"] == 2 * 8 * 128 * tokens
    assert mha_t["q_k"] - gqa_t["q_k"] == 2 * (32 - 8) * 128 * tokens


def test_swiglu_keeps_four_ffn_wide_tensors_gelu_two():
    llama = load_model("llama2-7b")
    gelu = dataclasses.replace(llama, mlp="gelu")
    f, tokens = llama.ffn_hidden, 1024
    assert layer_activation_terms(llama, 1024, 1)["mlp_inner"] == 4 * 2 * f * tokens
    assert layer_activation_terms(gelu, 1024, 1)["mlp_inner"] == 2 * 2 * f * tokens


def test_context_parallel_divides_tokens():
    llama = load_model("llama2-7b")
    one = sum(layer_activation_terms(llama, 8192, 1).values())
    four = sum(layer_activation_terms(llama, 8192, 1, cp=4).values())
    assert four == pytest.approx(one / 4)


def test_dropout_masks_only_when_dropout_positive():
    no_drop = dataclasses.replace(GPT, dropout=0.0)
    terms = layer_activation_terms(no_drop, S, B, fused_attention=False)
    assert not any("dropout" in k for k in terms)
    # without dropout the paper's 34 + 5as/h becomes 32 + 2as/h
    assert sum(terms.values()) == pytest.approx(SBH * (32 + 2 * A * S / H))


def test_fp32_activations_cost_twice_bf16():
    # mixed precision: activations take 2 bytes per element in mixed precision, 4 in fp32
    no_drop = dataclasses.replace(GPT, dropout=0.0)
    bf16 = sum(layer_activation_terms(no_drop, S, B, dtype_bytes=2, fused_attention=False).values())
    fp32 = sum(layer_activation_terms(no_drop, S, B, dtype_bytes=4, fused_attention=False).values())
    assert fp32 == pytest.approx(2 * bf16)


def test_moe_terms_scale_with_top_k():
    mixtral = load_model("mixtral-8x7b")
    top1 = dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, top_k=1))
    routed = ("experts", "expert_act", "expert_output", "moe_permuted")
    two = sum(layer_activation_terms(mixtral, 1024, 1)[k] for k in routed)
    one = sum(layer_activation_terms(top1, 1024, 1)[k] for k in routed)
    assert two == pytest.approx(2 * one)
    # per routed copy: input h (the permuted token), SwiGLU 4f, output h, in bf16
    assert one == pytest.approx(2 * (2 * mixtral.hidden + 4 * mixtral.moe.expert_ffn_hidden) * 1024)


# ---- pipeline schedules ----------------------------------------------------

@pytest.mark.parametrize("pp,rank,m,expected", [(4, 0, 8, 4), (4, 3, 8, 1), (4, 1, 2, 2), (1, 0, 16, 1)])
def test_1f1b_in_flight(pp, rank, m, expected):
    assert in_flight_microbatches("1f1b", pp, rank, m, 1) == expected


def test_gpipe_holds_every_microbatch():
    assert in_flight_microbatches("gpipe", 4, 3, 16, 1) == 16


@pytest.mark.parametrize("pp,v", [(4, 2), (8, 4), (2, 3)])
def test_interleaved_first_stage_factor(pp, v):
    # Korthikanti section 4.2.3: the first stage holds pp micro-batches times 1 + (p-1)/(p*v)
    got = in_flight_microbatches("interleaved-1f1b", pp, 0, 64, v)
    assert got == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))


def test_interleaved_capped_by_the_step():
    assert in_flight_microbatches("interleaved-1f1b", 4, 0, 4, 2) <= 4


def test_pytorch_sequence_parallel_saves_the_gathered_projection_inputs():
    """DTensor SP (meshplan) gathers the sequence before q/k/v and w1/w3 and autograd keeps the gathered
    tensor: those two inputs stay 2sbh; Megatron keeps its shard (Korthikanti's 34/t)."""
    megatron = _terms(tp=8, sequence_parallel=True)
    torch_sp = _terms(tp=8, sequence_parallel=True, sp_saves_gathered=True)
    for key in ("qkv_input", "mlp_input"):
        assert megatron[key] == pytest.approx(2 * SBH / 8) and torch_sp[key] == pytest.approx(2 * SBH)
    assert sum(torch_sp.values()) - sum(megatron.values()) == pytest.approx(2 * 2 * SBH * (1 - 1 / 8))
