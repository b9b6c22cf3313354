"""Model features and layouts meshplan's executor does not build, and module lists an engine refuses.

Rule by rule why the executor refuses (planner.engines.registry.executor_refusal
asks these, and the executor imports that function, so a plan for `--engine
meshplan` is one `meshplan execute` runs):
- MoE layers stay replicated over tp, so sequence parallel (which would cut
  their output back to sequence shards) is refused with them;
- offload is only FSDP2's CPUOffloadPolicy (optimizer+params under ZeRO-3);
- float8 runs through torchao on GPUs of compute capability 8.9 or newer, tp 1.
"""

from __future__ import annotations

from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec

# Model features executor/model.py and executor/moe.py build: anything else is refused by name.
_MODEL_DEFAULTS = dict(attention_sinks=False, norms_per_layer=2, mtp_layers=0, glu_clamp=0.0)
_MOE_DEFAULTS = dict(expert_bias=False, capacity_factor=0.0)
# Hugging Face families whose numerics the executor computes (transformers' modeling code of each), and
# "" for presets and meshplan's own ModelSpec JSON; the others, with what their modeling code adds.
BUILT_FAMILIES = ("", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3",
                  "gpt2")
_UNBUILT_FAMILIES = {
    "gemma": "embeddings scaled by sqrt(hidden), RMSNorm weights as 1 + w",
    "gemma2": "embeddings scaled by sqrt(hidden), RMSNorm as 1 + w, logit soft-capping",
    "phi3": "fused qkv_proj and gate_up_proj",
    "deepseek_v2": "softmax group-limited routing",
    "kimi_k2": "remote modeling code",
    "gpt_oss": "attention sinks, clamped SwiGLU",
    "grok-1": "remote modeling code",
    "llama4": "chunked attention, no-rope layers, L2 q/k norm",
    "llama4_text": "chunked attention, no-rope layers, L2 q/k norm",
}


def unbuilt_features(model: ModelSpec) -> list[str]:
    """Names of the model's features the executor has no module for (the family, fields, rope kinds)."""
    from planner.model.blocks import ROPE_SCALING_KINDS

    out = []
    family = getattr(model, "family", "")
    if family not in BUILT_FAMILIES:
        out.append(f"family {family} ({_UNBUILT_FAMILIES.get(family, 'its own modeling code')})")
    out += [k for k, v in _MODEL_DEFAULTS.items() if getattr(model, k, v) != v]
    scaling = getattr(model, "rope_scaling", None)
    if scaling is not None and scaling.kind not in ROPE_SCALING_KINDS:
        out.append(f"rope_scaling {scaling.kind}")
    if model.moe is not None:
        out += [f"moe.{k}" for k, v in _MOE_DEFAULTS.items() if getattr(model.moe, k, v) != v]
        if model.moe.router_bias and model.moe.scoring != "sigmoid":  # GPT-OSS: a bias on the router's logits
            out.append("moe.router_bias with softmax scoring")
    return out


def fp8_refusal(model: ModelSpec, layout: Layout, training: TrainingSpec, on_gpu: bool) -> str | None:
    """What the executor's torchao float8 path (executor.components.float8) does not run."""
    if training.precision != "fp8":
        return (f"precision {training.precision}: the executor's 8-bit path is torchao's float8 (tensorwise "
                "scaling); plan with --precision fp8 or bf16, or --engine megatron for mxfp8")
    if not on_gpu:
        return ("precision fp8 on CPU ranks: float8 GEMMs (torch._scaled_mm) need a GPU of compute capability "
                "8.9 or newer (H100, L4, B200...); plan CPU ranks with --precision bf16")
    if layout.tp > 1:
        return (f"precision fp8 with tp ({layout.tp}) > 1: the executor does not apply torchao's float8 "
                "tensor-parallel styles; plan with --tp 1 or --precision bf16")
    if training.dtype != "bf16":
        return f"precision fp8 runs on bf16 compute (torchtitan's recipe), not {training.dtype}; plan with --dtype bf16"
    return None


def recompute_modules_refusal(engine_name: str, has_modules: bool, model: ModelSpec, layout: Layout,
                              training: TrainingSpec | None) -> str | None:
    """Why `layout.recompute_modules` cannot run: an engine without Megatron-Core's module list, or a module
    Megatron-Core's TransformerConfig refuses for this model (mla_up_proj without MLA, moe_act without the
    grouped-GEMM experts it is written for)."""
    modules = layout.recompute_modules
    if not modules:
        return None
    named = f"recompute_modules {','.join(modules)}"
    if not has_modules:
        return (f"engine {engine_name} has no per-module selective recomputation ({named}); it is Megatron-Core's "
                "--recompute-modules: plan with --engine megatron, or drop --recompute-modules")
    if "mla_up_proj" in modules and model.mla is None:
        return f"{named}: mla_up_proj recomputes MLA's up-projections, and {model.name} has no MLA attention"
    if "moe_act" in modules and (model.moe is None or (training is not None and not training.moe_grouped_gemm)):
        why = f"{model.name} has no MoE layers" if model.moe is None else "the experts run without grouped GEMM"
        return f"{named}: Megatron-Core recomputes moe_act only in grouped-GEMM experts, and {why}"
    return None
