"""What LoRA keeps on a rank: a frozen base, small trained adapters, and the activations the frozen path saves.

LoRA (Hu et al. 2021) adds beside a target linear W (out x in) two trained
matrices, lora_A (r x in) and lora_B (out x r); the base stays frozen. On a
tensor-parallel rank the adapters are split consistently with their base
(executor.lora, with DTensor's parallel styles):

  column-parallel base (q, k, v, gate, up: W split on out)
      lora_A split on r (r/t x in, its m x r output all-gathered), lora_B
      split on out (out/t x r)
  row-parallel base (o, down: W split on in)
      lora_A split on in (r x in/t, its partial m x r output reduced),
      lora_B whole (out x r)
The adapters' own collectives move m x r elements: left out of the step time.

Routed experts and MLA projections are not adapted (LoRA targets the dense
attention projections and the dense or shared MLP; `lora_refusal` says so for
models whose attention has no q/k/v/o linears of that kind).

Model states on a rank (planner.memory.states calls `lora_stage_states`):
  frozen base    D bytes per parameter (the compute dtype; QLoRA: NF4, half a
                 byte per block-linear weight plus a scale per 64 weights, the
                 embedding, head and norms in D), sharded like any parameter by
                 ZeRO-3 / FSDP; no gradient, no optimizer state, no fp32 master
  adapters       the engine's recipe, as any trained parameter (meshplan:
                 fp32 parameter, fp32 gradient, two fp32 Adam moments)

Activations (`lora_activation_terms`, applied to the terms of
planner.memory.activations): a frozen linear keeps no input for a weight
gradient (autograd saves mm's input only when the weight needs a gradient),
so a block whose q, k, v are all untargeted drops "qkv_input", one whose gate
and up are untargeted drops "mlp_input", and an untargeted down projection
drops the product it multiplies (one f-wide tensor of "mlp_inner"); every
adapter keeps lora_A's output (r per token, D bytes) for lora_B's gradient,
and lora_A's input is the base's input (saved once).
"""

from __future__ import annotations

from functools import lru_cache

from planner.memory.params import StageParams, ceil_div
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec

COLUMN_TARGETS = ("q", "k", "v", "gate", "up")  # base split on its output features under TP
ROW_TARGETS = ("o", "down")  # base split on its input features
# QLoRA's NF4: 4 bits per weight and one fp32 scale per block of 64 (torchao's NF4Tensor, double quantization off)
NF4_BYTES_PER_WEIGHT = 0.5 + 4 / 64


def lora_refusal(model: ModelSpec, training: TrainingSpec) -> str | None:
    """Why LoRA cannot adapt `model` as `training` asks (one sentence), or None."""
    if not training.lora:
        return None
    if model.mla is not None:
        return (f"LoRA adapts q, k, v, o projections; {model.name} uses multi-head latent attention, whose "
                "projections are not adapted: fine-tune it fully (--finetune full)")
    if model.mlp != "swiglu" and "gate" in training.lora_targets and len(training.lora_targets) == 1:
        return f"--lora-targets gate: {model.name} has a GELU MLP without a gate projection; target up or down"
    if model.moe is not None and model.n_moe_layers == model.n_layers and \
            not set(training.lora_targets) & {"q", "k", "v", "o"}:
        return (f"--lora-targets {','.join(training.lora_targets)}: every layer of {model.name} is a MoE layer whose "
                "routed experts are not adapted; target q, k, v or o")
    return None


def target_shapes(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable linear of a block, whole (before TP)."""
    h, f = model.hidden, model.ffn_hidden
    shapes = {"q": (h, model.q_dim), "k": (h, model.kv_dim), "v": (h, model.kv_dim), "o": (model.q_dim, h),
              "up": (h, f), "down": (f, h)}
    if model.mlp == "swiglu":
        shapes["gate"] = (h, f)
    return shapes


def _mlp_target(name: str) -> bool:
    return name in ("gate", "up", "down")


@lru_cache(maxsize=4096)
def adapter_params_per_layer(model: ModelSpec, targets: tuple[str, ...], rank: int, tp: int) -> tuple[float, float]:
    """(adapter parameters of an attention-only layer, of a layer whose MLP is adapted too) on one TP rank."""
    attention = mlp = 0.0
    for name, (n_in, n_out) in target_shapes(model).items():
        if name not in targets:
            continue
        if name in COLUMN_TARGETS:
            count = ceil_div(rank, tp) * n_in + ceil_div(n_out, tp) * rank
        else:
            count = rank * ceil_div(n_in, tp) + n_out * rank
        if _mlp_target(name):
            mlp += count
        else:
            attention += count
    return attention, attention + mlp


def dense_mlp_layers(model: ModelSpec, layers: int) -> int:
    """Layers among `layers` whose MLP is dense (adapted by MLP targets): MoE layers' routed experts are not."""
    if model.moe is None:
        return layers
    return round(layers * (1 - model.n_moe_layers / model.n_layers))


def stage_adapter_params(model: ModelSpec, training: TrainingSpec, tp: int, sp: StageParams) -> int:
    """Adapter parameters one rank of the stage holding `sp` trains."""
    attention_only, with_mlp = adapter_params_per_layer(model, training.lora_targets, training.lora_rank, tp)
    dense = dense_mlp_layers(model, sp.layers)
    return round(dense * with_mlp + (sp.layers - dense) * attention_only)


def base_bytes(model: ModelSpec, training: TrainingSpec, sp: StageParams) -> float:
    """Bytes of the frozen base of the stage holding `sp` on one rank before ZeRO (D per parameter; QLoRA's
    block linears in NF4)."""
    d = training.dtype_bytes
    if training.finetune != "qlora":
        return d * sp.total
    linear = max(0, sp.total - sp.root - model.norms_per_layer * model.norm_params * sp.layers)
    return NF4_BYTES_PER_WEIGHT * linear + d * (sp.total - linear)


def lora_activation_terms(model: ModelSpec, training: TrainingSpec, tp: int, tokens: float,
                          terms: dict[str, float]) -> dict[str, float]:
    """The saved-tensor terms of one layer (planner.memory.activations.layer_activation_terms, bytes) under LoRA
    (module docstring)."""
    targets = set(training.lora_targets)
    d = training.dtype_bytes
    out = dict(terms)
    if not targets & {"q", "k", "v"} and "qkv_input" in out:
        out["qkv_input"] = 0.0
    if not targets & {"gate", "up"} and "mlp_input" in out:
        out["mlp_input"] = 0.0
    if "down" not in targets and "mlp_inner" in out:
        dense_share = 1.0 if model.moe is None else 1 - model.n_moe_layers / model.n_layers
        out["mlp_inner"] = max(0.0, out["mlp_inner"] - dense_share * tokens * d * model.ffn_hidden / tp)
    dense_share = 1.0 if model.moe is None else 1 - model.n_moe_layers / model.n_layers
    n_adapters = sum((dense_share if _mlp_target(t) else 1.0) for t in targets if t in target_shapes(model))
    out["lora_a_output"] = tokens * d * training.lora_rank * n_adapters
    return out
