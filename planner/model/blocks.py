"""The parts of a ModelSpec that only some families have: mixture-of-experts MLPs and MLA attention.

ModelSpec (planner.model.spec) counts their parameters and FLOPs; these
classes only hold and check the shape values.
"""

from __future__ import annotations

from dataclasses import dataclass

from topologies.errors import ModelError

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

    def __post_init__(self) -> None:
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            low = 0 if key in ("q_lora_rank", "qk_nope_head_dim") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low or value > 1 << 16:
                raise ModelError(f"MLA {key} must be an integer in [{low}, 65536], got {value!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
