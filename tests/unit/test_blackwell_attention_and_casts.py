"""Blackwell pricing: the softmax exponentials at the SFU rate beside the attention MMAs, and 8-bit cast bytes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.layout import Layout
from planner.model.presets import PRESETS
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import (
    FP8_ANY_LAYOUT_CAST_BYTES,
    FP8_CAST_BYTES,
    MXFP8_CAST_BYTES,
    attention_core_times,
    fp8_cast_bytes,
    fp8_peak_flops,
    layer_times,
)
from topologies.errors import TopologyError
from topologies.hardware import GPUSpec, get_gpu

CAL = CalibrationProfile(gemm_efficiency=0.5, gemm_knee=64.0, attention_efficiency=0.6, memory_efficiency=0.8)


def test_blackwell_ultra_doubles_the_exponential_rate_at_the_same_tensor_core_peak():
    for base, ultra in (("gb200", "gb300"), ("b200", "b300")):
        b, u = get_gpu(base), get_gpu(ultra)
        assert u.peak_flops("bf16") == b.peak_flops("bf16")
        assert u.exp_per_s == pytest.approx(2.0 * b.exp_per_s)
    # one exponential per 512 dense BF16 FLOPs: at head dim 128 the MMAs of a score take as long as its exp
    gb200 = get_gpu("gb200")
    assert gb200.exp_per_s * 512 == pytest.approx(gb200.peak_flops("bf16"))
    assert get_gpu("h100-sxm").exp_per_s == 0.0  # not catalogued: the fitted efficiency covers the softmax


def test_the_exponential_rate_is_validated():
    spec = dataclasses.asdict(get_gpu("gb200"))
    with pytest.raises(TopologyError, match="exp_per_s"):
        GPUSpec(**{**spec, "exp_per_s": math.nan})


def test_fused_attention_adds_the_sfu_time_to_the_mma_time():
    gb200, gb300 = get_gpu("gb200"), get_gpu("gb300")
    peak = gb200.peak_flops("bf16")
    heads, s, d = 8, 8192, 128
    scores = heads * s * s * 0.5
    fwd, bwd = attention_core_times(heads, s, s, d, 2, 0.0, True, gb200, peak, CAL)
    mma, exp = 4 * scores * d / peak, scores / gb200.exp_per_s
    assert fwd == pytest.approx((mma + exp) / 0.6)
    assert bwd == pytest.approx((2.5 * mma + exp) / 0.6)  # 5 products against 2, P recomputed once
    fwd_ultra, bwd_ultra = attention_core_times(heads, s, s, d, 2, 0.0, True, gb300, peak, CAL)
    assert fwd_ultra == pytest.approx((mma + exp / 2) / 0.6)
    assert 1.0 < fwd / fwd_ultra < 2.0 and 1.0 < bwd / bwd_ultra < fwd / fwd_ultra


def test_without_a_catalogued_rate_attention_is_the_mma_time_alone():
    h100 = get_gpu("h100-sxm")
    peak = h100.peak_flops("bf16")
    fwd, bwd = attention_core_times(8, 4096, 4096, 128, 2, 0.0, True, h100, peak, CAL)
    assert fwd == pytest.approx(4 * 8 * 4096 * 4096 * 128 * 0.5 / (peak * 0.6))
    assert bwd == pytest.approx(2.5 * fwd)


def test_cast_bytes_follow_the_layouts_the_fp8_gemms_accept():
    h100, gb200 = get_gpu("h100-sxm"), get_gpu("gb200")
    assert fp8_cast_bytes("fp8", h100) == FP8_CAST_BYTES == 4.0  # 8-bit copy and its transpose
    assert fp8_cast_bytes("fp8", gb200) == FP8_ANY_LAYOUT_CAST_BYTES == 3.0  # one copy serves both layouts
    assert fp8_cast_bytes("mxfp8", gb200) == MXFP8_CAST_BYTES == pytest.approx(2 + 2 * 33 / 32)
    assert fp8_cast_bytes("bf16", gb200) == 0.0


def test_mxfp8_is_slower_than_per_tensor_fp8_by_its_cast_bytes_alone():
    model, gpu = PRESETS["llama3-8b"], get_gpu("b200")
    layout = Layout(micro_batch_size=1)
    peak = gpu.peak_flops("bf16")

    def times(precision: str, cast_bytes: float):
        return layer_times(model, 8192, 2, layout, gpu, peak, CAL, fp8_peak=fp8_peak_flops(precision, gpu),
                           cast_bytes=cast_bytes)

    fp8, mx = times("fp8", fp8_cast_bytes("fp8", gpu)), times("mxfp8", fp8_cast_bytes("mxfp8", gpu))
    assert mx.forward_s > fp8.forward_s and mx.backward_s > fp8.backward_s
    assert times("mxfp8", FP8_ANY_LAYOUT_CAST_BYTES).forward_s == pytest.approx(fp8.forward_s)
    assert mx.forward_s / fp8.forward_s < 1.05  # a few percent, as the published pairs show (2-7% on a step)
