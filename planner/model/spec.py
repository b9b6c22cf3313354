"""ModelSpec: what is trained, as a frozen description of a decoder-only transformer.

A ModelSpec never knows its cluster or its layout. Parameter counts and FLOPs
are derived from the shape fields, never stored, so a spec cannot disagree
with itself.

Parameter count of one layer (h = hidden, a = n_heads, k = n_kv_heads,
d = head_dim, f = ffn_hidden):
  attention  q: h*a*d, k and v: h*k*d each, o: a*d*h   (+ a*d + 2*k*d + h biases)
  MLP        swiglu: 3*h*f   gelu: 2*h*f               (+ f + h biases)
  norms      norms_per_layer (2; 4 in Gemma 2 and Grok-1): h each (rmsnorm) or 2h each (layernorm)
Model: layers + token embedding V*h (+ learned positions S*h) + final norm
+ output layer V*h unless tied. For GPT-style configs this equals Megatron's
12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) plus the final LayerNorm's 2h.

Family extensions, each counted where its Hugging Face modeling code holds
weights: MLA replaces q, k, v (MLASpec); q/k/v-only biases (Qwen2), attention
biases with o (GPT-OSS), one sink logit per head (GPT-OSS), q/k RMSNorm of
head_dim (Qwen3). Mixture of experts (MoESpec): the MoE layers' MLP is
n_experts routed experts (+ biases in GPT-OSS), a router of h*E (+ E biases
for GPT-OSS and DeepSeek-V3's score correction), shared experts (+ Qwen2's
h-wide shared-expert gate); the other layers keep the dense MLP of
ffn_hidden. Multi-token-prediction modules (DeepSeek-V3) are counted apart
(`mtp_params`), as the published totals leave them out. These counts match
the published totals of DeepSeek-V3/V2, Kimi-K2, Qwen3-MoE, Qwen2-MoE,
GPT-OSS, Mixtral, Grok-1 and Llama 4 (tests/unit/test_model_moe.py).

Execution fields (plan.json schema 3) change no count or FLOP: the family the
spec was read from, rope theta and scaling, the norms' epsilon, the MLP's
activation, which layers slide (`window_of`) and, in MoESpec, the router's
scoring, renormalization, scaling and groups. The executor computes the
model from them as each family's Hugging Face modeling code does.

Training FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B):
6 * N_matmul + 12 * l * s * a*d (6 * l * s * a*(qk + v) with MLA's two head
widths; sliding-window layers count min(window, s) keys), where N_matmul counts the weights that take
part in matrix multiplies (the output layer included, the embedding lookup
not) and the attention term is forward + backward of QK^T and AV without the
causal halving. Recomputation adds forward work on top (see
`training_flops_per_token`); "model FLOPs" for MFU never include it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from planner.model.blocks import MLASpec, MoESpec, RopeScaling
from topologies.errors import ModelError

__all__ = ["MLASpec", "ModelSpec", "MoESpec", "RopeScaling"]

MLP_KINDS = ("swiglu", "gelu")
# The MLP's activation (transformers' hidden_act / activation_function): silu (SwiGLU's gate), gelu_tanh
# (GPT-2's gelu_new, gelu_pytorch_tanh), gelu (erf). "" means the MLP kind's own: silu for swiglu,
# gelu_tanh for gelu.
ACTIVATIONS = ("", "silu", "gelu_tanh", "gelu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned", "alibi")


@lru_cache(maxsize=1024)
def _count_moe_layers(moe: MoESpec, n_layers: int) -> int:
    return sum(1 for i in range(n_layers) if moe.is_moe_layer(i))


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
    mla: MLASpec | None = None  # multi-head latent attention replaces q, k, v (head_dim = qk width)
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2)
    attention_bias: bool = False  # biases on q, k, v and o (GPT-OSS attention_bias)
    attention_sinks: bool = False  # one learned logit per head and layer (GPT-OSS)
    qk_norm: bool = False  # RMSNorm of head_dim on queries and keys (Qwen3)
    norms_per_layer: int = 2  # 4 with post-attention/post-MLP norms (Gemma 2, Grok-1)
    sliding_window: int = 0  # local attention window of the sliding layers (0: none)
    sliding_layers: int = 0  # how many layers use it (GPT-OSS and Gemma 2: every other one)
    mtp_layers: int = 0  # multi-token-prediction modules after the last layer (DeepSeek-V3)
    glu_clamp: float = 0.0  # GLU inputs clamped to this limit before the activation (GPT-OSS swiglu_limit 7; 0: none)
    # What execution needs beyond the shapes (plan.json schema 3); no parameter count or FLOP depends on them.
    family: str = ""  # Hugging Face model_type the spec was read from ("": a preset or meshplan's own JSON)
    rope_theta: float = 10_000.0  # rotary base (Llama 2 10k, Llama 3 500k, Qwen 1M)
    rope_scaling: RopeScaling | None = None  # context extension of the rotary frequencies
    norm_eps: float = 1e-5  # epsilon of every RMSNorm / LayerNorm (rms_norm_eps, layer_norm_epsilon)
    activation: str = ""  # see ACTIVATIONS
    sliding_layer_ids: tuple[int, ...] = ()  # which layers slide (len == sliding_layers); () = the default rule

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
        self._check_extensions()
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"model {self.name!r}: dropout must be in [0, 1), got {self.dropout}")

    def _check_extensions(self) -> None:
        """The MoE, MLA and per-family fields (ModelSpec JSON may hold any value)."""
        if self.moe is not None and not isinstance(self.moe, MoESpec):
            raise ModelError(f"model {self.name!r}: moe must be an object of MoE keys or null, got {self.moe!r}")
        if self.mla is not None and not isinstance(self.mla, MLASpec):
            raise ModelError(f"model {self.name!r}: mla must be an object of MLA keys or null, got {self.mla!r}")
        for key in ("tie_embeddings", "bias", "qkv_bias", "attention_bias", "attention_sinks", "qk_norm"):
            if not isinstance(getattr(self, key), bool):
                raise ModelError(f"model {self.name!r}: {key} must be true or false, got {getattr(self, key)!r}")
        for key, low, high in (("norms_per_layer", 1, 8), ("sliding_window", 0, 1 << 24),
                               ("sliding_layers", 0, self.n_layers), ("mtp_layers", 0, 64)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ModelError(f"model {self.name!r}: {key} must be an integer in [{low}, {high}], got {value!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ModelError(f"model {self.name!r}: dropout must be a number, got {self.dropout!r}")
        clamp = self.glu_clamp
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not 0.0 <= clamp < float("inf"):
            raise ModelError(f"model {self.name!r}: glu_clamp must be a finite number >= 0 (0: no clamp), "
                             f"got {clamp!r}")
        self._check_execution_fields()

    def _check_execution_fields(self) -> None:
        """family, rope, eps, activation and the sliding layers (plan.json schema 3)."""
        if not isinstance(self.family, str):
            raise ModelError(f"model {self.name!r}: family must be a string, got {self.family!r}")
        for key, low, high in (("rope_theta", 1.0, 1e12), ("norm_eps", 1e-12, 1.0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ModelError(f"model {self.name!r}: {key} must be a number in [{low:g}, {high:g}], got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ModelError(f"model {self.name!r}: rope_scaling must be an object of rope keys or null, "
                             f"got {self.rope_scaling!r}")
        if self.activation not in ACTIVATIONS:
            raise ModelError(f"model {self.name!r}: activation must be one of {ACTIVATIONS[1:]} (or \"\" for the "
                             f"MLP's own), got {self.activation!r}")
        ids = self.sliding_layer_ids
        if not isinstance(ids, tuple) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 and 0 <= i < self.n_layers for i in ids):
            raise ModelError(f"model {self.name!r}: sliding_layer_ids must be layer indices below n_layers "
                             f"({self.n_layers}), got {ids!r}")
        if ids and (len(set(ids)) != len(ids) or len(ids) != self.sliding_layers):
            raise ModelError(f"model {self.name!r}: sliding_layer_ids {list(ids)} must name sliding_layers "
                             f"({self.sliding_layers}) distinct layers")

    # ---- execution ----------------------------------------------------------

    @property
    def mlp_activation(self) -> str:
        """The MLP's activation: the spec's, or its MLP kind's own (silu for swiglu, gelu_tanh for gelu)."""
        return self.activation or ("silu" if self.mlp == "swiglu" else "gelu_tanh")

    def window_of(self, layer: int) -> int:
        """The attention window of a layer (0: full causal attention).

        The sliding layers are sliding_layer_ids; without them, every layer when sliding_layers ==
        n_layers (Mistral), else the even layers (Gemma 2, GPT-OSS: sliding first, then alternating).
        """
        if not self.sliding_window or not self.sliding_layers:
            return 0
        if self.sliding_layer_ids:
            return self.sliding_window if layer in self.sliding_layer_ids else 0
        if self.sliding_layers == self.n_layers or layer % 2 == 0 and layer // 2 < self.sliding_layers:
            return self.sliding_window
        return 0

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
    def v_head_dim(self) -> int:
        """Width of one value head: head_dim, or MLA's v_head_dim."""
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def _mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def norm_params(self) -> int:
        """Parameters of one norm layer."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def attention_params(self) -> int:
        """Parameters of one attention block (projections, biases, sinks, q/k norms, MLA's norms)."""
        h, a = self.hidden, self.n_heads
        if self.mla is not None:
            m = self.mla
            q = h * a * m.qk_head_dim if not m.q_lora_rank else (
                h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * a * m.qk_head_dim)
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + \
                m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
            weights, q_width, kv_width = q + kv + a * m.v_head_dim * h, a * m.qk_head_dim, a * (m.qk_head_dim + m.v_head_dim)
        else:
            weights = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
            q_width, kv_width = self.q_dim, 2 * self.kv_dim
        biases = 0
        if self.bias or self.attention_bias:
            biases = q_width + kv_width + h
        elif self.qkv_bias:
            biases = q_width + kv_width
        extras = (a if self.attention_sinks else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return weights + biases + extras

    def _dense_mlp_params(self, ffn: int) -> int:
        biases = (ffn + self.hidden) if self.bias else 0
        return self._mlp_matrices * self.hidden * ffn + biases

    @property
    def one_expert_params(self) -> int:
        """Parameters of one routed expert."""
        assert self.moe is not None
        f = self.moe.expert_ffn_hidden
        biases = ((self._mlp_matrices - 1) * f + self.hidden) if self.moe.expert_bias else 0
        return self._dense_mlp_params(f) + biases

    @property
    def n_moe_layers(self) -> int:
        """Layers whose MLP is the mixture of experts (0 for dense models)."""
        return 0 if self.moe is None else _count_moe_layers(self.moe, self.n_layers)

    @property
    def dense_mlp_params(self) -> int:
        """Parameters of one dense MLP (the MLP of every layer of a dense model)."""
        return self._dense_mlp_params(self.ffn_hidden)

    @property
    def mlp_params(self) -> int:
        """Parameters of one layer's MLP; for MoE the MoE layer's: all experts, router and shared experts."""
        if self.moe is None:
            return self.dense_mlp_params
        return self.expert_params_per_layer + self._moe_dense_params_per_layer

    @property
    def expert_params_per_layer(self) -> int:
        """Routed-expert parameters of one MoE layer (0 for dense models): what EP shards."""
        if self.moe is None:
            return 0
        return self.moe.n_experts * self.one_expert_params

    @property
    def router_params(self) -> int:
        """The router of one MoE layer: h*E weights (+ E biases)."""
        if self.moe is None:
            return 0
        return self.moe.n_experts * (self.hidden + (1 if self.moe.router_bias else 0))

    @property
    def shared_expert_params(self) -> int:
        """The shared experts of one MoE layer and their gate."""
        if self.moe is None:
            return 0
        shared_ffn = self.moe.shared_ffn_hidden or self.moe.expert_ffn_hidden
        gate = self.hidden if self.moe.shared_expert_gate else 0
        return self.moe.n_shared_experts * self._dense_mlp_params(shared_ffn) + gate

    @property
    def _moe_dense_params_per_layer(self) -> int:
        """Router and shared experts: replicated across expert-parallel ranks."""
        return self.router_params + self.shared_expert_params

    @property
    def layer_base_params(self) -> int:
        """Attention and norms: what every layer holds besides its MLP."""
        return self.attention_params + self.norms_per_layer * self.norm_params

    @property
    def params_per_layer(self) -> int:
        """Parameters of an average layer (MoE models mix dense and MoE layers)."""
        return (self.n_layers * self.layer_base_params + self._all_mlp_params) // self.n_layers

    @property
    def _all_mlp_params(self) -> int:
        n_moe = self.n_moe_layers
        return n_moe * self.mlp_params + (self.n_layers - n_moe) * self.dense_mlp_params

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
    def mtp_params(self) -> int:
        """Multi-token-prediction modules (DeepSeek-V3): each one layer (MoE when the model is),
        a 2h -> h projection and three norms; they share the embedding and the output layer.
        Not in total_params, as the published counts leave them out (671B + 14B MTP)."""
        if not self.mtp_layers:
            return 0
        mlp = self.mlp_params if self.moe is not None else self.dense_mlp_params
        return self.mtp_layers * (self.layer_base_params + mlp + 2 * self.hidden * self.hidden
                                  + 3 * self.norm_params)

    @property
    def total_params(self) -> int:
        return self.n_layers * self.layer_base_params + self._all_mlp_params + self.embedding_params + \
            self.output_params

    @property
    def active_params(self) -> int:
        """Parameters touched by one token: for MoE only top_k routed experts count.

        The embedding table is counted (one row is read); publishers differ
        (DeepSeek and OpenAI leave it out of their active counts, Mistral and
        Qwen count it): subtract embedding_params to compare with the former.
        """
        if self.moe is None:
            return self.total_params
        inactive = (self.moe.n_experts - self.moe.top_k) * self.one_expert_params
        return self.total_params - self.n_moe_layers * inactive

    @property
    def matmul_params(self) -> int:
        """Active weights that take part in matrix multiplies: layers + output projection.

        The embedding lookup is a gather (no FLOPs); a tied output layer still
        multiplies by V*h weights. Norms and biases are counted with the layers
        because they are too small to matter and keep the formula simple.
        """
        layers_active = self.active_params - self.embedding_params - self.output_params
        return layers_active + self.vocab * self.hidden

    # ---- FLOPs ------------------------------------------------------------

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of QK^T and AV per token: 12 * l * s * a*d.

        With MLA the key width (qk) and value width (v) differ: 6 * l * s * a*(qk + v).
        Sliding-window layers see min(window, s) keys.
        """
        width = self.n_heads * (self.head_dim + self.v_head_dim)
        sliding = self.sliding_layers if self.sliding_window else 0
        keys = (self.n_layers - sliding) * seq_len + sliding * min(self.sliding_window, seq_len)
        return 6.0 * keys * width

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
        if isinstance(kwargs.get("sliding_layer_ids"), list):
            kwargs["sliding_layer_ids"] = tuple(kwargs["sliding_layer_ids"])
        for key, kind in (("moe", MoESpec), ("mla", MLASpec), ("rope_scaling", RopeScaling)):
            block = kwargs.get(key)
            if isinstance(block, dict):
                known = {f.name for f in dataclasses.fields(kind)}
                values = {k: v for k, v in block.items() if k in known}
                if isinstance(values.get("dense_layers"), list):
                    values["dense_layers"] = tuple(values["dense_layers"])
                try:
                    kwargs[key] = kind(**values)
                except TypeError as exc:
                    raise ModelError(f"model JSON has a malformed {key!r} block: {exc}") from None
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ModelError(f"model JSON is malformed: {exc}") from None
