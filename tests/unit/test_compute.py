"""The compute time model: FLOP accounting against published formulas, and its shape behaviour."""

from __future__ import annotations

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import (
    attention_core_times,
    combine,
    gemm_flops,
    gemm_time_s,
    layer_gemms,
    layer_times,
    memory_time_s,
)
from topologies.hardware import get_gpu

A100 = get_gpu("a100-80g-sxm")
PEAK = A100.peak_flops("bf16")
CAL = CalibrationProfile(gemm_efficiency=0.8, gemm_knee=64.0, attention_efficiency=0.5, memory_efficiency=0.8)


def gpt(h=4096, layers=32, heads=32, vocab=51200, seq=2048) -> ModelSpec:
    return ModelSpec(name="gpt", n_layers=layers, hidden=h, n_heads=heads, n_kv_heads=heads, head_dim=h // heads,
                     ffn_hidden=4 * h, vocab=vocab, max_seq_len=seq, mlp="gelu", norm="layernorm",
                     position="learned", tie_embeddings=True, bias=True)


def test_large_gemm_runs_at_the_calibrated_efficiency():
    m = n = k = 16384
    flops = 2 * m * n * k
    expected = flops / (PEAK * 0.8) * (1 + 3 * 64 / 16384)
    assert gemm_time_s(m, n, k, PEAK, CAL) == pytest.approx(expected)
    assert gemm_time_s(m, n, k, PEAK, CAL) == pytest.approx(flops / (PEAK * 0.8), rel=0.02)


def test_tensor_parallel_shrinks_gemms_and_lowers_their_efficiency():
    """Same work split t ways: each shard runs at a worse FLOP rate as its n dimension shrinks."""
    seconds_per_flop = [gemm_time_s(8192, 16384 / t, 4096, PEAK, CAL) / (2 * 8192 * 16384 / t * 4096)
                        for t in (1, 2, 4, 8, 16, 32)]
    assert seconds_per_flop == sorted(seconds_per_flop)
    assert seconds_per_flop[-1] > 1.1 * seconds_per_flop[0]


def test_empty_gemm_costs_nothing():
    assert gemm_time_s(0, 128, 128, PEAK, CAL) == 0.0


def test_memory_time_is_bytes_over_effective_bandwidth():
    assert memory_time_s(2039e9, A100, CAL) == pytest.approx(1 / 0.8)


@pytest.mark.parametrize("gpu_s,host_s", [(1.0, 0.5), (0.2, 0.9), (1.0, 1.0), (3.0, 0.0)])
def test_combine_lies_between_the_max_and_the_sum(gpu_s, host_s):
    for p in (1.0, 2.0, 4.0, 50.0):
        t = combine(gpu_s, host_s, p)
        assert max(gpu_s, host_s) - 1e-12 <= t <= gpu_s + host_s + 1e-12
    assert combine(gpu_s, host_s, 1.0) == pytest.approx(gpu_s + host_s)


def test_megatron_flops_formula_with_full_recompute():
    """Narayanan et al. 2021 (eq. 3): 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) FLOPs per iteration.

    Our accounting: layer GEMMs and the attention core (4*b*s^2*h forward) run
    4 times (forward, recompute, two backward products), the output layer 3
    times. Megatron's formula drops biases, norms and the GELU, as we do.
    """
    model, b, s = gpt(), 8, 2048
    layout = Layout(micro_batch_size=b, recompute="full")
    layer = gemm_flops(layer_gemms(model, b * s, layout))
    attention_fwd = 4 * b * s * s * model.hidden
    output = 2 * b * s * model.hidden * model.vocab
    ours = model.n_layers * 4 * (layer + attention_fwd) + 3 * output
    h, n_layers, V = model.hidden, model.n_layers, model.vocab
    megatron = 96 * b * s * n_layers * h**2 * (1 + s / (6 * h) + V / (16 * n_layers * h))
    assert ours == pytest.approx(megatron, rel=1e-9)


@pytest.mark.parametrize("name", ["llama3-8b", "13B", "mixtral-8x7b"])
def test_layer_gemms_match_the_models_six_n_accounting(name):
    """3 passes of the GEMMs = 6 * matmul weights per token (PaLM appendix B), biases and norms aside."""
    model = load_model(name)
    tokens = 4096
    layout = Layout(micro_batch_size=1, ep=1)
    per_token = 3 * gemm_flops(layer_gemms(model, tokens, layout)) * model.n_layers / tokens
    weights = model.matmul_params - model.vocab * model.hidden
    if model.moe is not None:  # routed experts: only top_k of them see a token
        assert per_token == pytest.approx(6 * weights, rel=0.01)
    else:
        assert per_token == pytest.approx(6 * weights, rel=0.002)


def test_gemm_flops_split_evenly_over_tensor_parallel_ranks():
    model = load_model("13B")
    one = gemm_flops(layer_gemms(model, 4096, Layout()))
    for tp in (2, 4, 8):
        assert tp * gemm_flops(layer_gemms(model, 4096, Layout(tp=tp))) == pytest.approx(one)


def test_recompute_adds_work_in_order():
    model = load_model("13B")
    times = {r: layer_times(model, 4096, 2, Layout(micro_batch_size=1, recompute=r), A100, PEAK, CAL)
             for r in ("none", "selective", "full")}
    assert times["none"].recompute_s == 0
    assert 0 < times["selective"].recompute_s < times["full"].recompute_s
    assert times["full"].recompute_s == pytest.approx(times["full"].forward_s)
    assert times["none"].backward_s < times["selective"].backward_s < times["full"].backward_s


def test_fused_causal_attention_runs_half_the_tiles_at_attention_efficiency():
    heads, s, d = 32, 4096, 128
    fwd, bwd = attention_core_times(heads, s, s, d, 2, 0.0, True, A100, PEAK, CAL)
    assert fwd == pytest.approx(4 * heads * s * s * d * 0.5 / (PEAK * 0.5))
    assert bwd == pytest.approx(2.5 * fwd)


def test_unfused_attention_pays_for_the_score_matrix():
    """Eager attention streams the s x s scores through HBM: it grows faster with s than the fused kernel."""
    ratios = []
    for s in (1024, 4096, 16384):
        fused = attention_core_times(32, s, s, 128, 2, 0.1, True, A100, PEAK, CAL)[0]
        eager = attention_core_times(32, s, s, 128, 2, 0.1, False, A100, PEAK, CAL)[0]
        ratios.append(eager / fused)
    assert all(r > 1 for r in ratios)


def test_a_bigger_micro_batch_is_never_less_efficient_per_token():
    model = load_model("13B")
    per_token = [layer_times(model, 2048, 2, Layout(micro_batch_size=b, tp=8), A100, PEAK, CAL).forward_s / b
                 for b in (1, 2, 4, 8)]
    assert per_token == sorted(per_token, reverse=True)


def test_a_clamped_glu_pays_its_unfused_clamp_passes():
    """GPT-OSS's clamp (Megatron-Core's weighted_bias_quick_geglu_impl clamps both halves and concatenates
    them outside the fused kernel): 8 passes of the experts' activation width forward, 10 backward, and
    8 more where moe_act is recomputed; nothing else in the layer changes."""
    import dataclasses

    clamped = load_model("gpt-oss-20b")
    plain = dataclasses.replace(clamped, glu_clamp=0.0)
    layout = Layout(dp_shard=8, zero_stage=1, ep=8, micro_batch_size=2, recompute="selective",
                    recompute_modules=("moe_act",))
    a, b = (layer_times(m, 4096, 2, layout, A100, PEAK, CAL) for m in (clamped, plain))
    width = 2 * 2 * 4096 * clamped.moe.top_k * clamped.moe.expert_ffn_hidden  # bytes of one pass: b*s rows
    assert a.forward_s - b.forward_s == pytest.approx(memory_time_s(8 * width, A100, CAL))
    assert a.backward_input_s - b.backward_input_s == pytest.approx(memory_time_s(10 * width, A100, CAL))
    assert a.recompute_s - b.recompute_s == pytest.approx(memory_time_s(8 * width, A100, CAL))
    assert a.backward_weight_s == b.backward_weight_s


def test_expert_output_biases_pay_their_eager_weighted_add():
    """GPT-OSS's fc2 biases, weighted by the routing probabilities after the GEMM (Megatron-Core's
    TEGroupedMLP._apply_bias): 6 passes of the hidden width per routed row forward, 8 backward."""
    import dataclasses

    biased = load_model("gpt-oss-20b")
    plain = dataclasses.replace(biased, moe=dataclasses.replace(biased.moe, expert_bias=False))
    layout = Layout(dp_shard=8, zero_stage=1, ep=8, micro_batch_size=2)
    cal = CAL.replace(moe_imbalance=1.0)
    a, b = (layer_times(m, 4096, 2, layout, A100, PEAK, cal) for m in (biased, plain))
    rows = 2 * 4096 * biased.moe.top_k
    assert a.forward_s - b.forward_s == pytest.approx(memory_time_s(6 * 2 * rows * biased.hidden, A100, cal))
    assert a.backward_input_s - b.backward_input_s == pytest.approx(
        memory_time_s(8 * 2 * rows * biased.hidden, A100, cal))

