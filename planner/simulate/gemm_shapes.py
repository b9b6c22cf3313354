"""GEMM shapes of one transformer layer on one rank: (count, m, n, k) per forward GEMM.

planner.simulate.compute prices them (`gemm_time_s`); planner.simulate.recompute
picks the ones a recomputed module runs again; planner.simulate.tp_overlap
chunks them under async TP. m is the rank's tokens per micro-batch (b*s/cp).
"""

from __future__ import annotations

from planner.layout import Layout
from planner.model.spec import ModelSpec


def attention_gemms(model: ModelSpec, m: float, tp: int) -> list[tuple[float, float, float, float]]:
    """(count, m, n, k) of the attention projections of one layer on one TP rank.

    MLA (DeepSeek-V2/V3): the down projections (q_a, kv_a) are replicated on
    every TP rank, the up projections (q_b, kv_b) and o are split by heads.
    """
    h = model.hidden
    if model.mla is None:
        return [(1.0, m, (model.q_dim + 2 * model.kv_dim) / tp, h), (1.0, m, h, model.q_dim / tp)]
    a, mla = model.n_heads, model.mla
    out = [(1.0, m, mla.kv_lora_rank + mla.qk_rope_head_dim, h),
           (1.0, m, a * (mla.qk_nope_head_dim + mla.v_head_dim) / tp, mla.kv_lora_rank),
           (1.0, m, h, a * mla.v_head_dim / tp)]
    if mla.q_lora_rank:
        out += [(1.0, m, mla.q_lora_rank, h), (1.0, m, a * mla.qk_head_dim / tp, mla.q_lora_rank)]
    else:
        out.append((1.0, m, a * mla.qk_head_dim / tp, h))
    return out


def moe_fraction(model: ModelSpec) -> float:
    """Share of the layers whose MLP is the mixture of experts: the simulator's average layer mixes them."""
    return model.n_moe_layers / model.n_layers if model.moe is not None else 0.0


def mlp_gemms(model: ModelSpec, m: float, layout: Layout
              ) -> tuple[list[tuple[float, float, float, float]], list[tuple[float, float, float, float]]]:
    """(dense GEMMs, routed-expert GEMMs) of an average layer's MLP on one rank, forward.

    MoE, balanced routing: the MoE block runs on the m/tp tokens of its rank
    (sequence parallel, as Megatron-Core requires with TP); each token goes to
    top_k experts, an expert's tokens are gathered over its etp ranks, so a
    rank runs n_experts/ep experts of m*top_k*etp*ep/(tp*n_experts) tokens,
    each 1/etp of the expert's width. Shared experts and the router run
    like the dense MLP. Dense and MoE layers are mixed by `moe_fraction`.
    """
    h, tp = model.hidden, layout.tp
    up = 2 if model.mlp == "swiglu" else 1

    def mlp(count: float, tokens: float, ffn: float) -> list[tuple[float, float, float, float]]:
        return [(count, tokens, up * ffn, h), (count, tokens, h, ffn)]

    f = moe_fraction(model)
    dense = dense_mlp_gemms(model, m, tp)
    if model.moe is None:
        return dense, []
    moe = model.moe
    dense += shared_expert_gemms(model, m, tp)
    dense.append((f, m, moe.n_experts, h))  # router
    tokens = m * moe.top_k * layout.etp * layout.ep / (tp * moe.n_experts)
    experts = mlp(f * moe.n_experts / layout.ep, tokens, moe.expert_ffn_hidden / layout.etp)
    return dense, experts


def dense_mlp_gemms(model: ModelSpec, m: float, tp: int) -> list[tuple[float, float, float, float]]:
    """The dense MLP's two GEMMs (up, down) in the average layer: weighed by the dense layers' share."""
    f = moe_fraction(model)
    return _mlp(model, 1.0 - f, m, model.ffn_hidden / tp) if f < 1.0 else []


def shared_expert_gemms(model: ModelSpec, m: float, tp: int) -> list[tuple[float, float, float, float]]:
    """The shared experts' GEMMs in the average layer, run like a dense MLP on every token of the MoE layers."""
    moe = model.moe
    if moe is None or not moe.n_shared_experts:
        return []
    return _mlp(model, moe_fraction(model) * moe.n_shared_experts, m,
                (moe.shared_ffn_hidden or moe.expert_ffn_hidden) / tp)


def _mlp(model: ModelSpec, count: float, tokens: float, ffn: float) -> list[tuple[float, float, float, float]]:
    up = 2 if model.mlp == "swiglu" else 1
    return [(count, tokens, up * ffn, model.hidden), (count, tokens, model.hidden, ffn)]


def mla_up_gemms(model: ModelSpec, m: float, tp: int) -> list[tuple[float, float, float, float]]:
    """(count, m, n, k) of MLA's up projections on one TP rank, as `attention_gemms` lists them: kv
    (kv_lora_rank -> a*(nope + v)) and q (q_lora_rank -> a*qk, or the hidden state without q compression)."""
    a, mla = model.n_heads, model.mla
    return [(1.0, m, a * (mla.qk_nope_head_dim + mla.v_head_dim) / tp, mla.kv_lora_rank),
            (1.0, m, a * mla.qk_head_dim / tp, mla.q_lora_rank or model.hidden)]


def layer_gemms(model: ModelSpec, m: float, layout: Layout) -> tuple[tuple[float, float, float, float], ...]:
    """(count, m, n, k) of every forward GEMM of an average layer on one rank (see the module docstring)."""
    dense, experts = mlp_gemms(model, m, layout)
    return tuple(attention_gemms(model, m, layout.tp) + dense + experts)


def gemm_flops(gemms: tuple[tuple[float, float, float, float], ...]) -> float:
    return sum(2.0 * count * m * n * k for count, m, n, k in gemms)
