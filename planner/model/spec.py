"""ModelSpec: what is trained, as a frozen description of a decoder-only transformer.

A ModelSpec never knows its cluster or its layout. Parameter counts and FLOPs
are derived from the shape fields, never stored, so a spec cannot disagree
with itself.

Parameter count of one layer (h = hidden, a = n_heads, k = n_kv_heads,
d = head_dim, f = ffn_hidden):
  attention  q: h*a*d, k and v: h*k*d each, o: a*d*h   (+ a*d + 2*k*d + h biases)
  MLP        swiglu: 3*h*f   gelu: 2*h*f               (+ f + h biases)
  norms      2 per layer: h each (rmsnorm) or 2h each (layernorm)
Model: layers + token embedding V*h (+ learned positions S*h) + final norm
+ output layer V*h unless tied. For GPT-style configs this equals Megatron's
12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) plus the final LayerNorm's 2h.

Training FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B):
6 * N_matmul + 12 * l * s * a*d, where N_matmul counts the weights that take
part in matrix multiplies (the output layer included, the embedding lookup
not) and the attention term is forward + backward of QK^T and AV without the
causal halving. Recomputation adds forward work on top (see
`training_flops_per_token`); "model FLOPs" for MFU never include it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from topologies.errors import ModelError

MLP_KINDS = ("swiglu", "gelu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned", "alibi")


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLP: every layer's MLP is n_experts experts, top_k active."""

    n_experts: int
    top_k: int
    expert_ffn_hidden: int
    n_shared_experts: int = 0  # always-active experts (Qwen-MoE, DeepSeek style)
    shared_ffn_hidden: int = 0  # inner size of each shared expert; 0 means expert_ffn_hidden

    def __post_init__(self) -> None:
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ModelError(
                f"MoE needs 1 <= top_k ({self.top_k}) <= n_experts ({self.n_experts})"
            )
        if self.expert_ffn_hidden < 1:
            raise ModelError(f"MoE expert_ffn_hidden must be positive, got {self.expert_ffn_hidden}")


# Upper bounds far above any published model (Llama 3 405B: 126 layers, hidden
# 16384, vocab 128256; Gemini-class vocabularies ~256k): beyond them a config is
# a typo, and building or simulating it would only exhaust memory.
_SIZE_LIMITS = {"n_layers": 4096, "hidden": 1 << 18, "n_heads": 1 << 14, "n_kv_heads": 1 << 14,
                "head_dim": 1 << 14, "ffn_hidden": 1 << 21, "vocab": 1 << 24, "max_seq_len": 1 << 24}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Field comments give the symbol used in docstrings."""

    name: str
    n_layers: int  # l
    hidden: int  # h
    n_heads: int  # a, query heads
    n_kv_heads: int  # k, key/value heads (== a for MHA, < a for GQA/MQA)
    head_dim: int  # d, usually h / a
    ffn_hidden: int  # f, inner size of the dense MLP
    vocab: int  # V
    max_seq_len: int  # S, native context length
    mlp: str = "swiglu"  # "swiglu": 3 matrices | "gelu": 2 matrices
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    position: str = "rope"  # "rope" | "learned" (S*h parameters) | "alibi"
    tie_embeddings: bool = False  # output layer shares the token embedding
    bias: bool = False  # linear layers carry biases (GPT-2/3, BLOOM)
    dropout: float = 0.0  # dropout probability; masks cost memory only when > 0
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ModelError(f"model name must be a string, got {self.name!r}")
        for key, limit in _SIZE_LIMITS.items():
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"model {self.name!r}: {key} must be a positive integer, got {value!r}")
            if value > limit:
                raise ModelError(f"model {self.name!r}: {key} = {value} is beyond any real model (at most {limit}); "
                                 "check the config")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(
                f"model {self.name!r}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        for key, allowed in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("position", POSITION_KINDS)):
            if getattr(self, key) not in allowed:
                raise ModelError(f"model {self.name!r}: {key} must be one of {allowed}, got {getattr(self, key)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"model {self.name!r}: dropout must be in [0, 1), got {self.dropout}")

    # ---- parameter counts -------------------------------------------------

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads, a*d."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads, k*d."""
        return self.n_kv_heads * self.head_dim

    @property
    def _mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def norm_params(self) -> int:
        """Parameters of one norm layer."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def attention_params(self) -> int:
        """Parameters of one attention block (q, k, v, o and their biases)."""
        h = self.hidden
        weights = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        biases = (self.q_dim + 2 * self.kv_dim + h) if self.bias else 0
        return weights + biases

    def _dense_mlp_params(self, ffn: int) -> int:
        biases = (ffn + self.hidden) if self.bias else 0
        return self._mlp_matrices * self.hidden * ffn + biases

    @property
    def mlp_params(self) -> int:
        """Parameters of one layer's MLP; for MoE all experts, router and shared experts."""
        if self.moe is None:
            return self._dense_mlp_params(self.ffn_hidden)
        return self.expert_params_per_layer + self._moe_dense_params_per_layer

    @property
    def expert_params_per_layer(self) -> int:
        """Routed-expert parameters of one layer (0 for dense models): what EP shards."""
        if self.moe is None:
            return 0
        return self.moe.n_experts * self._dense_mlp_params(self.moe.expert_ffn_hidden)

    @property
    def _moe_dense_params_per_layer(self) -> int:
        """Router and shared experts: replicated across expert-parallel ranks."""
        assert self.moe is not None
        shared_ffn = self.moe.shared_ffn_hidden or self.moe.expert_ffn_hidden
        return self.hidden * self.moe.n_experts + self.moe.n_shared_experts * self._dense_mlp_params(shared_ffn)

    @property
    def params_per_layer(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding plus learned positions (the first pipeline stage holds these)."""
        positions = self.max_seq_len * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + positions

    @property
    def output_params(self) -> int:
        """Final norm plus output layer (0 for the layer when tied): the last stage's extra."""
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.norm_params + head

    @property
    def total_params(self) -> int:
        return self.n_layers * self.params_per_layer + self.embedding_params + self.output_params

    @property
    def active_params(self) -> int:
        """Parameters touched by one token: for MoE only top_k routed experts count."""
        if self.moe is None:
            return self.total_params
        inactive = (self.moe.n_experts - self.moe.top_k) * self._dense_mlp_params(self.moe.expert_ffn_hidden)
        return self.total_params - self.n_layers * inactive

    @property
    def matmul_params(self) -> int:
        """Active weights that take part in matrix multiplies: layers + output projection.

        The embedding lookup is a gather (no FLOPs); a tied output layer still
        multiplies by V*h weights. Norms and biases are counted with the layers
        because they are too small to matter and keep the formula simple.
        """
        per_layer_active = (self.active_params - self.embedding_params - self.output_params) // self.n_layers
        return self.n_layers * per_layer_active + self.vocab * self.hidden

    # ---- FLOPs ------------------------------------------------------------

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of QK^T and AV per token: 12 * l * s * a*d."""
        return 12.0 * self.n_layers * seq_len * self.q_dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """Useful training FLOPs per token (no recomputation): the numerator of MFU."""
        return 6.0 * self.matmul_params + self.attention_flops_per_token(seq_len)

    def training_flops_per_token(self, seq_len: int, recompute: str = "none") -> float:
        """FLOPs the hardware executes per token, recomputation included.

        full: one more forward of every layer (2 * layer matmul weights + 4*l*s*a*d).
        selective: only the attention core is recomputed (4*l*s*a*d, Korthikanti et al.).
        op: per-op SAC recomputes about every second matmul (torchtitan's policy).
        """
        base = self.model_flops_per_token(seq_len)
        attn_fwd = self.attention_flops_per_token(seq_len) / 3.0
        if recompute == "none":
            return base
        if recompute == "selective":
            return base + attn_fwd
        layer_weights = self.matmul_params - self.vocab * self.hidden
        if recompute == "op":  # per-op SAC: about every second matmul again, attention saved
            return base + layer_weights
        if recompute == "full":
            return base + 2.0 * layer_weights + attn_fwd
        raise ModelError(f"recompute must be none, selective, op or full, got {recompute!r}")

    # ---- (de)serialization -------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        """Build from meshplan's own ModelSpec JSON; unknown keys are ignored."""
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ModelError(f"model JSON is missing required keys: {', '.join(missing)}")
        kwargs = {k: v for k, v in data.items() if k in fields}
        moe = kwargs.get("moe")
        if isinstance(moe, dict):
            moe_fields = {f.name for f in dataclasses.fields(MoESpec)}
            try:
                kwargs["moe"] = MoESpec(**{k: v for k, v in moe.items() if k in moe_fields})
            except TypeError as exc:
                raise ModelError(f"model JSON has a malformed 'moe' block: {exc}") from None
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ModelError(f"model JSON is malformed: {exc}") from None
