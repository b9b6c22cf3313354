"""Selective recomputation of Megatron-Core's named modules: the forward work each redoes in the backward.

Megatron-Core's `--recompute-granularity selective --recompute-modules ...`
(TransformerConfig.recompute_modules, default ["core_attn"]) wraps modules of a
layer in checkpoints; what each drops from memory is
planner.memory.activations.RECOMPUTED_TERMS, what it costs again is here,
priced with the same GEMM and memory-bound rates as the layer's forward
(planner.simulate.compute.layer_times adds the sum to the backward's
recompute time, planner.simulate.step the communication of `recomputed_comm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.layout import Layout, selective_modules
from planner.model.spec import ModelSpec
from planner.simulate.gemm_shapes import dense_mlp_gemms, mla_up_gemms, moe_fraction, shared_expert_gemms

# A clamped GLU (ModelSpec.glu_clamp, GPT-OSS's swiglu_limit) runs its clamp outside the fused activation:
# Megatron-Core 0.15-0.18 (megatron/core/fusions/fused_bias_geglu.py, weighted_bias_quick_geglu_impl)
# chunks fc1's output, clamps each half (read f, write f each) and concatenates them again (read 2f,
# write 2f) before the fused kernel: 8 passes of f elements forward. Backward: each clamp's masked
# gradient (read the saved input and the gradient, write: 3f each) and the halves' gradients joined
# again for fc1's backward (read 2f, write 2f): 10. Hugging Face's reference experts clamp unfused too.
GLU_CLAMP_PASSES_FORWARD = 8.0
GLU_CLAMP_PASSES_BACKWARD = 10.0


# Routed experts with output biases (GPT-OSS) add fc2's bias weighted by each token's routing probability
# after the GEMM: Megatron-Core 0.15-0.18 TEGroupedMLP builds fc2 with skip_bias_add and _apply_bias splits
# the output by local expert, forms bias * probability and adds it (per expert, eager), then concatenates
# the pieces: per routed row of h elements, write h, read 2h and write h, read and write h: 6 passes
# forward (probabilities in the activations' dtype, the router's without moe_router_dtype). Backward:
# the product's two gradients (each a multiply, read and write h, and its reduction, read h) and the
# split's gradient joined again (read and write h): 8.
EXPERT_BIAS_PASSES_FORWARD = 6.0
EXPERT_BIAS_PASSES_BACKWARD = 8.0


def glu_clamp_passes(model: ModelSpec) -> tuple[float, float]:
    """(forward, backward) memory passes per element of the activation's width that the GLU clamp adds
    (0, 0 without a clamp or a gate)."""
    if not model.glu_clamp or model.mlp != "swiglu":
        return 0.0, 0.0
    return GLU_CLAMP_PASSES_FORWARD, GLU_CLAMP_PASSES_BACKWARD


@dataclass(frozen=True)
class ModuleParts:
    """What `layer_times` already priced that `module_forward_s` reuses: the attention core's forward, how a
    module's GEMMs and memory-bound bytes are priced, and the routed experts' GEMMs (with their casts) and MoE
    memory-bound work (router, permutation) of the average layer."""

    core_f: float
    gemms_s: Callable[[list[tuple[float, float, float, float]]], float]
    bytes_s: Callable[[float], float]
    experts_s: float
    moe_memory_s: float


def module_forward_s(model: ModelSpec, module: str, m: float, dtype_bytes: int, layout: Layout,
                     parts: ModuleParts) -> float:
    """Forward GPU time of one of Megatron-Core's selectively recomputed modules in the average layer, which its
    recomputation runs again in the backward (what each drops: planner.memory.activations.RECOMPUTED_TERMS).

    core_attn: the attention core. mla_up_proj: the q and kv up projections
    (RoPE's elementwise pass is left out). layernorm: a read and a write of
    the hidden state per norm that is a module of its own (MLA's input norm,
    MoE layers' pre-MLP norm; the others are fused into their linears).
    moe_act: the routed experts' activation (the same passes per element as
    the forward's, a GLU clamp's included). mlp: the dense layers' MLP (GEMMs, activation, its
    fused norm). moe: the MoE layers' router, permutation, routed and shared
    experts. shared_experts: the shared experts' GEMMs and activation. The
    communication inside a recomputed mlp or moe is priced by
    planner.simulate.step (`recomputed_comm`).
    """
    h, tp, d = model.hidden, layout.tp, dtype_bytes
    act_passes = (3.0 if model.mlp == "swiglu" else 2.0) + glu_clamp_passes(model)[0]
    sp_div = tp if layout.sequence_parallel else 1
    f = moe_fraction(model)
    moe = model.moe
    routed_ffn = f * moe.top_k * moe.expert_ffn_hidden if moe is not None else 0.0
    shared_ffn = f * moe.n_shared_experts * (moe.shared_ffn_hidden or moe.expert_ffn_hidden) if moe else 0.0
    if module == "core_attn":
        return parts.core_f
    if module == "mla_up_proj":
        return parts.gemms_s(mla_up_gemms(model, m, tp)) if model.mla is not None else 0.0
    if module == "layernorm":
        norms = (1.0 if model.mla is not None else 0.0) + f
        return parts.bytes_s(norms * 2 * d * m * h / sp_div)
    if module == "moe_act":
        return parts.bytes_s(d * m * act_passes * routed_ffn / tp)
    if module == "mlp":
        return parts.gemms_s(dense_mlp_gemms(model, m, tp)) + parts.bytes_s(
            d * m * (1.0 - f) * (act_passes * model.ffn_hidden / tp + 2 * h / sp_div))
    if module == "shared_experts":
        return parts.gemms_s(shared_expert_gemms(model, m, tp)) + parts.bytes_s(d * m * act_passes * shared_ffn / tp)
    if module == "moe":
        if moe is None:
            return 0.0
        router = [(f, m, moe.n_experts, h)]
        return (parts.gemms_s(shared_expert_gemms(model, m, tp) + router) + parts.experts_s + parts.moe_memory_s
                + parts.bytes_s(d * m * act_passes * (routed_ffn + shared_ffn) / tp))
    raise ValueError(f"unknown recompute module {module!r}")


def recomputed_comm(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(TP points, expert all-to-all passes) the selectively recomputed modules of the average layer run again
    in the backward: a recomputed dense MLP repeats its TP point (sequence parallel's all-gather before fc1
    and reduce-scatter after fc2, or the all-reduce) in the dense layers; a recomputed MoE layer its TP point
    and its dispatch and combine, whose price `expert_comm_s` already weighs by the MoE layers' share."""
    modules = selective_modules(layout)
    f = moe_fraction(model)
    points = (1.0 - f) * ("mlp" in modules) + f * ("moe" in modules)
    return points, 1.0 if "moe" in modules and model.moe is not None else 0.0
