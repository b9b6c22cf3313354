"""The parts of a ModelSpec that only some families have: mixture-of-experts MLPs, MLA attention, rope scaling.

ModelSpec (planner.model.spec) counts their parameters and FLOPs; these
classes only hold and check the values. The routing and rope fields change
no count: they are what the executor needs to compute what the Hugging Face
modeling code of each family computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topologies.errors import ModelError

ROUTER_SCORING = ("softmax", "sigmoid")
ROPE_SCALING_KINDS = ("linear", "llama3", "yarn")  # what the executor computes; others are read and refused

# Kimi-K2 has 384 experts, DeepSeek-V3 8 of 256 active and 3 dense layers.
_MOE_LIMITS = {"n_experts": 1 << 16, "expert_ffn_hidden": 1 << 21, "n_shared_experts": 1 << 10,
               "shared_ffn_hidden": 1 << 21, "first_dense_layers": 4096, "layer_step": 4096}


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLP: n_experts routed experts of which top_k serve each token.

    Which layers are MoE (the others run the dense MLP of ModelSpec.ffn_hidden):
    layer i (0-based) is MoE when i >= first_dense_layers, i % layer_step ==
    layer_phase and i is not in dense_layers. The Hugging Face families map as
    DeepSeek-V2/V3, Kimi-K2: first_k_dense_replace, moe_layer_freq (phase 0);
    Qwen2/3-MoE: decoder_sparse_step (phase step - 1), mlp_only_layers;
    Llama 4: interleave_moe_layer_step (phase step - 1).
    """

    n_experts: int
    top_k: int
    expert_ffn_hidden: int
    n_shared_experts: int = 0  # always-active experts (Qwen-MoE, DeepSeek, Llama 4)
    shared_ffn_hidden: int = 0  # inner size of each shared expert; 0 means expert_ffn_hidden
    first_dense_layers: int = 0  # leading layers with the dense MLP (DeepSeek first_k_dense_replace)
    layer_step: int = 1  # every layer_step-th layer is MoE
    layer_phase: int = 0  # ... the ones with i % layer_step == layer_phase
    dense_layers: tuple[int, ...] = ()  # further layers forced dense (Qwen mlp_only_layers)
    router_bias: bool = False  # one bias per expert: GPT-OSS router bias, DeepSeek-V3 e_score_correction_bias
    expert_bias: bool = False  # biases in every expert's matrices (GPT-OSS)
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (h weights)
    capacity_factor: float = 0.0  # 0: dropless; else tokens an expert takes, over the balanced share
    # Routing (transformers' routers): "softmax" over the experts' logits (Mixtral, Qwen-MoE) or "sigmoid"
    # per expert (DeepSeek-V3, whose router_bias then only shifts the choice: e_score_correction_bias)
    scoring: str = "softmax"
    norm_topk_prob: bool = True  # the top_k weights renormalized to sum to 1 (Mixtral; Qwen-MoE's key)
    routed_scaling: float = 1.0  # routed experts' output scaled by this (DeepSeek routed_scaling_factor)
    n_group: int = 1  # experts in n_group groups; a token picks topk_group groups first (DeepSeek-V3)
    topk_group: int = 1

    def __post_init__(self) -> None:
        for key in ("n_experts", "top_k", "expert_ffn_hidden", "layer_step"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"MoE {key} must be a positive integer, got {value!r}")
        for key in ("n_shared_experts", "shared_ffn_hidden", "first_dense_layers", "layer_phase"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelError(f"MoE {key} must be a non-negative integer, got {value!r}")
        for key, limit in _MOE_LIMITS.items():  # far above any published model: beyond them, a typo
            if getattr(self, key) > limit:
                raise ModelError(f"MoE {key} = {getattr(self, key)} is beyond any real model (at most {limit})")
        if not 1 <= self.top_k <= self.n_experts:
            raise ModelError(
                f"MoE needs 1 <= top_k ({self.top_k}) <= n_experts ({self.n_experts})"
            )
        if self.layer_phase >= self.layer_step:
            raise ModelError(f"MoE layer_phase ({self.layer_phase}) must be below layer_step ({self.layer_step})")
        if not isinstance(self.dense_layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.dense_layers):
            raise ModelError(f"MoE dense_layers must be layer indices, got {self.dense_layers!r}")
        for key in ("router_bias", "expert_bias", "shared_expert_gate"):
            if not isinstance(getattr(self, key), bool):
                raise ModelError(f"MoE {key} must be true or false, got {getattr(self, key)!r}")
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not (cf == 0 or 1.0 <= cf <= 1e3):
            raise ModelError(f"MoE capacity_factor must be 0 (dropless) or in [1, 1000], got {cf!r}")
        self._check_routing()

    def _check_routing(self) -> None:
        if self.scoring not in ROUTER_SCORING:
            raise ModelError(f"MoE scoring must be one of {ROUTER_SCORING}, got {self.scoring!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ModelError(f"MoE norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        scale = self.routed_scaling
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < 1e6:
            raise ModelError(f"MoE routed_scaling must be a number in (0, 1e6), got {scale!r}")
        for key in ("n_group", "topk_group"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"MoE {key} must be a positive integer, got {value!r}")
        if self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise ModelError(f"MoE n_group ({self.n_group}) must divide n_experts ({self.n_experts}) and be >= "
                             f"topk_group ({self.topk_group})")
        if self.topk_group * (self.n_experts // self.n_group) < self.top_k:
            raise ModelError(f"MoE topk_group ({self.topk_group}) groups of {self.n_experts // self.n_group} experts "
                             f"hold fewer than top_k ({self.top_k}) experts")

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense_layers and i % self.layer_step == self.layer_phase and i not in self.dense_layers


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): low-rank query and key/value paths.

    Per layer, a heads of qk = nope + rope query/key width and v value width:
      q   h*qr + qr (norm) + qr*a*qk    (without q compression, q_lora_rank 0: h*a*qk)
      kv  h*(kvr + rope) + kvr (norm) + kvr*a*(nope + v)
      o   a*v*h
    """

    q_lora_rank: int  # 0: queries projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the rotary dimensions stored as interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's checkpoints;
    # transformers' rope_interleave, default true) rather than as two halves
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            low = 0 if key in ("q_lora_rank", "qk_nope_head_dim") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low or value > 1 << 16:
                raise ModelError(f"MLA {key} must be an integer in [{low}, 65536], got {value!r}")
        if not isinstance(self.rope_interleave, bool):
            raise ModelError(f"MLA rope_interleave must be true or false, got {self.rope_interleave!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RopeScaling:
    """How a family stretches rotary positions beyond its pre-training context (transformers' rope_parameters).

    kind "linear": every inverse frequency divided by factor (positions interpolated);
    "llama3": wavelengths above original_max_position / low_freq_factor divided by factor, below
    original_max_position / high_freq_factor kept, smoothly blended between (Llama 3.1);
    "yarn" (Peng et al. 2023): per-dimension blend of interpolated and original frequencies over the
    correction range of beta_fast..beta_slow rotations, cos and sin scaled by attention_factor (0: derived
    from factor, mscale and mscale_all_dim as DeepSeek does). Other kinds (dynamic, longrope...) are read
    so the planner can plan them; the executor refuses them by name.
    """

    kind: str
    factor: float = 1.0
    original_max_position: int = 0  # pre-training context (llama3, yarn); 0: the model's max_seq_len
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek): 0 means unset
    mscale_all_dim: float = 0.0  # yarn (DeepSeek): also scales the softmax by its mscale squared
    attention_factor: float = 0.0  # yarn: 0 means derived
    truncate: bool = True  # yarn: correction range rounded to whole dimensions

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ModelError(f"rope_scaling kind must be a name such as {ROPE_SCALING_KINDS}, got {self.kind!r}")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                    "mscale_all_dim", "attention_factor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ModelError(f"rope_scaling {key} must be a finite number >= 0, got {value!r}")
        if self.factor <= 0:
            raise ModelError(f"rope_scaling factor must be > 0, got {self.factor!r}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelError(f"rope_scaling llama3 needs high_freq_factor ({self.high_freq_factor}) > "
                             f"low_freq_factor ({self.low_freq_factor})")
        value = self.original_max_position
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1 << 24:
            raise ModelError(f"rope_scaling original_max_position must be an integer >= 0, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ModelError(f"rope_scaling truncate must be true or false, got {self.truncate!r}")
