"""Attention modules: grouped-query attention (with the families' biases, q/k norms and sliding windows) and MLA.

`Attention` (Llama, Mistral, Qwen2/3, GPT-2...): q/k/v/o projections,
biases on q, k, v (Qwen2's qkv_bias) or on all four (attention_bias, GPT-2's
bias), an RMSNorm of head_dim on every query and key head before the
rotation (Qwen3's q_norm/k_norm), and, on a sliding layer, a window of W
keys: query i attends keys j with i - W < j <= i (transformers'
sliding_window_overlay).

`MLAttention` (DeepSeek-V2/V3, Kimi-K2; transformers' DeepseekV3Attention):
queries through a low-rank path wq_a -> q_norm -> wq_b (or one wq when
q_lora_rank is 0); one down-projection wkv_a to kv_lora_rank latent
dimensions plus a rotary key shared by every head; kv_norm; wkv_b up to
each head's key (nope part) and value. Query and key heads are
[nope | rope] of qk_head_dim; rotary dimensions stored interleaved are
de-interleaved first (executor.rope.deinterleave). Under yarn the softmax
scale carries DeepSeek's mscale.

Kernels: without a window, SDPA's causal mode (flash on CUDA, the CPU flash
kernel on CPU) with GQA's K/V shared by enable_gqa. With a window shorter
than the sequence, SDPA gets a boolean mask, and K/V are repeated to the
query heads first: on CUDA a mask rules out the flash kernel and, with
enable_gqa, leaves only the math kernel; with equal head counts the
memory-efficient kernel takes the mask. The CPU flash kernel takes masks.

Tensor parallelism (executor.parallel.parallelize.block_tp_plan) splits the
heads: every module reads its local head count from its input
(`view(..., -1, head_dim)`). MLA's shared rotary key is computed
identically on every tp rank but each rank attends it with its own heads, so
its gradient is a partial sum: `tp_mesh` (set by the TP plan) makes its
backward an all-reduce over tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from executor.parallel.context import ContextShard, cp_attention, window_mask
from executor.rope import deinterleave, rotate_half_apply, softmax_scale
from planner.model.spec import ModelSpec


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                   scale: float | None = None) -> torch.Tensor:
    """Causal softmax(QK^T * scale) V over (B, heads, S, d); GQA shares each KV head among a/k query heads.

    A window shorter than the sequence becomes an explicit mask (K/V repeated to the query heads: see the
    module docstring for the kernels this leaves).
    """
    seq = q.shape[2]
    if window and window < seq:
        if q.shape[1] != k.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        pos = torch.arange(seq, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(pos, pos, window), scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _norm(width: int, spec: ModelSpec, eps: float | None = None) -> nn.Module:
    return nn.RMSNorm(width, eps=spec.norm_eps if eps is None else eps)


class _AttentionBase(nn.Module):
    """What both attentions share: the window, the softmax scale, recomputation and context parallelism."""

    def __init__(self, spec: ModelSpec, window: int) -> None:
        super().__init__()
        self.window = window
        self.use_rope = spec.position == "rope"
        self.selective_recompute = False  # recompute the attention core (softmax(QK^T)V) in backward
        self.cp: ContextShard | None = None  # context parallel: K/V gathered over the cp group
        self.scale: float | None = None

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, heads, s, d) queries, keys, values -> (B, heads, s, d_v), as this rank's layout runs it."""
        if self.cp is not None:
            return cp_attention(q, k, v, self.cp, window=self.window, scale=self.scale)
        if self.selective_recompute and torch.is_grad_enabled():
            return checkpoint(attention_core, q, k, v, self.window, self.scale, use_reentrant=False)
        return attention_core(q, k, v, self.window, self.scale)


class Attention(_AttentionBase):
    def __init__(self, spec: ModelSpec, window: int = 0) -> None:
        super().__init__(spec, window)
        self.head_dim = spec.head_dim
        qkv_bias = spec.bias or spec.attention_bias or spec.qkv_bias
        self.wq = nn.Linear(spec.hidden, spec.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(spec.q_dim, spec.hidden, bias=spec.bias or spec.attention_bias)
        self.q_norm = _norm(spec.head_dim, spec) if spec.qk_norm else None
        self.k_norm = _norm(spec.head_dim, spec) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:  # per head, before the rotation (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:  # tables already cut to this rank's positions and cast once per forward
            q = rotate_half_apply(q, cos.to(q.dtype), sin.to(q.dtype))
            k = rotate_half_apply(k, cos.to(k.dtype), sin.to(k.dtype))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLAttention(_AttentionBase):
    """Multi-head latent attention (see the module docstring); names as torchtitan's DeepSeek-V3."""

    def __init__(self, spec: ModelSpec, window: int = 0) -> None:
        super().__init__(spec, window)
        m, h, a = spec.mla, spec.hidden, spec.n_heads
        self.nope, self.rope, self.v_dim, self.kv_rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, \
            m.kv_lora_rank
        self.interleaved = m.rope_interleave
        bias = spec.attention_bias
        if m.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_norm = _norm(m.q_lora_rank, spec, eps=1e-6)  # transformers' DeepseekV3RMSNorm default eps
            self.wq_b = nn.Linear(m.q_lora_rank, a * m.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(h, a * m.qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_norm = _norm(m.kv_lora_rank, spec, eps=1e-6)
        self.wkv_b = nn.Linear(m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.wo = nn.Linear(a * m.v_head_dim, h, bias=bias)
        self.scale = softmax_scale(spec, m.qk_head_dim)
        self.tp_mesh = None  # tensor parallel: the shared rotary key's gradient is all-reduced over it

    def _shared_key(self, k_rot: torch.Tensor) -> torch.Tensor:
        """The rotary key every local head attends: identity forward, all-reduce over tp in the backward."""
        if self.tp_mesh is None:
            return k_rot
        from torch.distributed.tensor import DTensor, Partial, Replicate

        return DTensor.from_local(k_rot, self.tp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, self.nope + self.rope)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, self.nope + self.v_dim)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = self._shared_key(k_rot).view(batch, seq, 1, self.rope)
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot = rotate_half_apply(q_rot, cos.to(q.dtype), sin.to(q.dtype))
        k_rot = rotate_half_apply(k_rot, cos.to(q.dtype), sin.to(q.dtype))
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, -1, k_pass.shape[2], -1)), dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
