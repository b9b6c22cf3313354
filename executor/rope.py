"""Rotary position embeddings: the frequencies each family uses, its context scaling, the rotation.

Frequencies of a rotary width d (head_dim, or MLA's qk_rope_head_dim):
inv_freq_i = theta^(-2i/d), i < d/2, with the spec's rope_theta. Context
scaling (ModelSpec.rope_scaling, transformers' modeling_rope_utils):

  linear  inv_freq / factor (positions interpolated by the factor);
  llama3  wavelengths 2 pi / inv_freq longer than original / low_freq_factor
          divided by factor, shorter than original / high_freq_factor kept,
          those between blended by (original / wavelength - low) / (high - low)
          (Llama 3.1's scaling);
  yarn    (Peng et al. 2023) per dimension a blend of interpolated and
          original frequencies, ramping over the dimensions that complete
          between beta_fast and beta_slow rotations in the original context;
          cos and sin scaled by the attention factor 0.1 ln(factor) + 1, or with
          DeepSeek's mscale and mscale_all_dim the ratio of those two terms.

cos/sin tables are (seq, 1, d) in the rotate-half layout (each angle twice:
dimension i pairs with i + d/2), applied as x*cos + rot(x)*sin.
"""

from __future__ import annotations

import math

import torch

from planner.model.spec import ModelSpec, RopeScaling

DEFAULT_THETA = 10_000.0  # RoFormer / Llama 2 base (ModelSpec.rope_theta's default)


def rotate_half_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half form: x*cos + rot(x)*sin, x of shape (B, S, heads, d).

    Pairs dimension i with i + d/2 (GPT-NeoX / Hugging Face Llama layout);
    angle of position p, pair i: p * inv_freq_i.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3)... -> halves (x0, x2, ...; x1, x3, ...), so rotate-half applies.

    DeepSeek's checkpoints store the rotary dimensions interleaved; transformers rotates the even/odd
    slices and returns them as halves (apply_rotary_pos_emb_interleave), which this followed by
    rotate_half_apply computes.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, dim: int, theta: float, original: int) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate it
    inv = inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation
    if s.attention_factor:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = _yarn_mscale(s.factor)
    return inv, factor


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, original: int) -> torch.Tensor:
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def inv_freq_and_factor(dim: int, theta: float = DEFAULT_THETA, scaling: RopeScaling | None = None,
                        max_seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of a rotary width `dim`, fp32 on CPU; the factor cos and sin are scaled by)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if scaling is None:
        return inv_freq, 1.0
    original = scaling.original_max_position or max_seq_len
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling, original), 1.0
    if scaling.kind == "yarn":
        return _yarn(inv_freq, scaling, dim, theta, original)
    raise ValueError(f"rope scaling {scaling.kind!r} is not computed here (planner.engines.refusals refuses it)")


def softmax_scale(spec: ModelSpec, qk_dim: int) -> float | None:
    """The attention's softmax scale when it is not 1/sqrt(qk_dim) (None: SDPA's default).

    DeepSeek's yarn multiplies it by mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale).
    """
    s = spec.rope_scaling
    if s is None or s.kind != "yarn" or not s.mscale_all_dim:
        return None
    return qk_dim ** -0.5 * _yarn_mscale(s.factor, s.mscale_all_dim) ** 2


def rope_tables(dim: int, seq_len: int, device: torch.device | str,
                spec: ModelSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, 1, dim), fp32: the spec's theta and scaling (default base without)."""
    theta, scaling, context = (spec.rope_theta, spec.rope_scaling, spec.max_seq_len) if spec else (DEFAULT_THETA,
                                                                                                 None, 0)
    inv_freq, factor = inv_freq_and_factor(dim, theta, scaling, context)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq.to(device))
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos() * factor, angles.sin() * factor
