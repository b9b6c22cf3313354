"""Hugging Face config.json -> ModelSpec, for the families whose every architecture key is read.

Every value is parsed into a typed, finite number before use: a string, null,
list, boolean, 0, 4096.5 or 1e400 where a positive integer belongs is an error
that names the file, the key and the value. A config whose `model_type` (or,
without one, `architectures`) names a family not listed in FAMILIES is refused
with the list: a Mamba or a vision model read as a Llama would be planned
wrongly without a word. A config with neither key is read as a Llama.

What each family adds to the Llama keys (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
vocab_size, tie_word_embeddings, attention_bias, sliding_window), following
the transformers modeling code of each family:
  gemma, gemma2      tied embeddings by default; gemma2 4 norms a layer,
                     every other layer (the even ones) local with sliding_window
  qwen2, qwen2_moe   q, k, v biases (no config key); sliding window only when
                     use_sliding_window is true
  qwen3, qwen3_moe   q/k RMSNorm of head_dim
  mixtral, qwen2/3_moe, deepseek_v2/v3, kimi_k2, gpt_oss, grok-1, llama4: MoESpec
  deepseek_v2/v3     MLA (q_lora_rank, kv_lora_rank, qk_nope/rope_head_dim,
                     v_head_dim), first_k_dense_replace, moe_layer_freq,
                     n_shared_experts, noaux_tc's per-expert score bias, MTP
  gpt_oss            biases in attention, router and experts, attention sinks,
                     layer_types for the sliding layers, swiglu_limit (the
                     clamp of the GLU's inputs)
  llama4             text_config; interleave_moe_layer_step, a shared expert,
                     intermediate_size_mlp for dense layers, chunked local
                     attention on 3 of 4 layers

What execution needs besides the shapes (ModelSpec's family, rope_theta,
rope_scaling, norm_eps, activation, sliding_layer_ids and MoE routing), with
the defaults of transformers 5.23's config classes when a key is absent:
rope as transformers 5 writes it (`rope_parameters`: rope_type, rope_theta,
factor...) or as 4.x did (`rope_theta` beside `rope_scaling`); `layer_types`
where a config lists them, else each family's rule for its sliding layers;
the routers' norm_topk_prob, routed_scaling_factor, n_group, topk_group and
DeepSeek-V3's sigmoid scoring.
"""

from __future__ import annotations

import math
from typing import Any

from planner.model.spec import MLASpec, ModelSpec, MoESpec, RopeScaling
from topologies.errors import ModelError

_LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads")
_GPT2_KEYS = ("n_embd", "n_layer", "n_head")

# model_type -> the class names that declare it (architectures).
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "mixtral": ("MixtralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen2_moe": ("Qwen2MoeForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "qwen3_moe": ("Qwen3MoeForCausalLM",),
    "gemma": ("GemmaForCausalLM",),
    "gemma2": ("Gemma2ForCausalLM",),
    "phi3": ("Phi3ForCausalLM",),
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "deepseek_v2": ("DeepseekV2ForCausalLM",),
    "deepseek_v3": ("DeepseekV3ForCausalLM",),
    "kimi_k2": (),
    "gpt_oss": ("GptOssForCausalLM",),
    "grok-1": ("Grok1ModelForCausalLM", "GrokForCausalLM"),
    "llama4": ("Llama4ForConditionalGeneration",),
    "llama4_text": ("Llama4ForCausalLM",),
}
_BY_ARCHITECTURE = {arch: family for family, archs in FAMILIES.items() for arch in archs}
# Families whose tie_word_embeddings defaults to true when the key is absent (their config classes).
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gpt2", "grok-1")
# Defaults of transformers 5.23's config classes for keys a config.json may leave out.
_NORM_EPS_DEFAULT = {"mixtral": 1e-5, "phi3": 1e-5, "grok-1": 1e-5, "gpt_oss": 1e-5}  # others: 1e-6
_THETA_DEFAULT = {"mixtral": 1e6}  # others: 10,000
_NORM_TOPK_DEFAULT = {"qwen2_moe": False, "qwen3_moe": False}  # Mixtral always, DeepSeek-V3 by default: true
_SIGMOID_ROUTERS = ("deepseek_v3", "kimi_k2")  # transformers' DeepseekV3TopkRouter: sigmoid + score bias
# hidden_act / activation_function -> ModelSpec.activation
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu": "gelu"}


class _Reader:
    """Typed access to one config's keys; errors name the file, the key and the value."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data, self.source = data, source

    def fail(self, key: str, what: str) -> ModelError:
        value = self.data.get(key)
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return ModelError(f"{self.source}: {key} must be {what}, got {shown}; fix the config or pass a preset")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def int(self, key: str, default: int | None = None, low: int = 1) -> int:
        if key not in self.data or (self.data[key] is None and default is not None):
            if default is None:
                raise ModelError(f"{self.source} is missing the required key {key}")
            return default
        value = self.data[key]
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, what)
        if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
            raise self.fail(key, what)
        if int(value) < low:
            raise self.fail(key, what)
        return int(value)

    def float(self, key: str, default: float) -> float:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, "a finite number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, "true or false")
        return value

    def str(self, key: str, default: str) -> str:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(key, "a string")
        return value

    def dict(self, key: str) -> dict[str, Any] | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, dict):
            raise self.fail(key, "an object of keys")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                  for v in value):
            raise self.fail(key, "a list of layer indices")
        return tuple(value)


def is_hf_config(data: dict[str, Any]) -> bool:
    """True when the JSON looks like a Hugging Face config rather than a ModelSpec."""
    return any(k in data for k in _LLAMA_KEYS + _GPT2_KEYS + ("model_type", "architectures", "text_config"))


def config_family(data: dict[str, Any], source: str = "config.json") -> str:
    """The family a config declares (model_type, else architectures), or "llama" when it names none."""
    model_type = data.get("model_type")
    if model_type is not None:
        if not isinstance(model_type, str):
            raise _Reader(data, source).fail("model_type", "a string")
        if model_type in FAMILIES:
            return model_type
        raise _unsupported(source, f"model_type {model_type!r}")
    archs = data.get("architectures")
    if archs is None:
        return "gpt2" if "n_embd" in data else "llama"
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise _Reader(data, source).fail("architectures", "a list of class names")
    for arch in archs:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    raise _unsupported(source, f"architectures {archs!r}")


def _unsupported(source: str, what: str) -> ModelError:
    return ModelError(f"{source}: {what} is not a supported architecture; meshplan reads the decoder-only "
                      f"transformer families {', '.join(FAMILIES)}; describe other models with a ModelSpec JSON")


def model_from_hf_config(data: dict[str, Any], default_name: str = "hf-model",
                         source: str = "config.json") -> ModelSpec:
    family = config_family(data, source)
    name = data.get("_name_or_path") or default_name
    if not isinstance(name, str) or not name.strip():
        name = default_name
    if family == "gpt2":
        return _from_gpt2(_Reader(data, source), name)
    if family == "llama4":  # the text model's keys sit under text_config
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise _Reader(data, source).fail("text_config", "an object of the text model's keys")
        merged = {k: v for k, v in data.items() if k != "text_config"}
        merged.update(text)
        merged.setdefault("tie_word_embeddings", data.get("tie_word_embeddings"))
        return _from_llama_like(_Reader(merged, source), name, "llama4_text")
    return _from_llama_like(_Reader(data, source), name, family)


def _moe(r: _Reader, family: str, n_layers: int) -> MoESpec | None:
    experts_key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if r.has(k)), None)
    if experts_key is None or (family in ("qwen2_moe", "qwen3_moe") and r.int(experts_key, low=0) == 0):
        if family in ("mixtral", "gpt_oss", "grok-1", "deepseek_v3", "kimi_k2", "llama4_text"):
            raise ModelError(f"{r.source}: a {family} config needs the number of experts "
                             "(n_routed_experts, num_experts or num_local_experts)")
        return None
    top_key = "num_experts_per_tok" if r.has("num_experts_per_tok") else "experts_per_token"
    expert_ffn_key = "moe_intermediate_size" if r.has("moe_intermediate_size") else "intermediate_size"
    shared_ffn = r.int("shared_expert_intermediate_size", 0, low=0)
    n_shared = r.int("n_shared_experts", 1 if shared_ffn else 0, low=0)
    first_dense, step, phase, dense = 0, 1, 0, ()
    if family in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        first_dense, step = r.int("first_k_dense_replace", 0, low=0), r.int("moe_layer_freq", 1)
    elif family in ("qwen2_moe", "qwen3_moe"):
        step = r.int("decoder_sparse_step", 1)
        phase, dense = step - 1, r.int_list("mlp_only_layers")
    elif family == "llama4_text":
        step, n_shared = r.int("interleave_moe_layer_step", 1), 1
        phase = step - 1
    return MoESpec(
        n_experts=r.int(experts_key),
        top_k=r.int(top_key, 2),
        expert_ffn_hidden=r.int(expert_ffn_key),
        n_shared_experts=n_shared,
        shared_ffn_hidden=shared_ffn,
        first_dense_layers=min(first_dense, n_layers),
        layer_step=step,
        layer_phase=phase,
        dense_layers=dense,
        router_bias=family == "gpt_oss" or r.str("topk_method", "") == "noaux_tc" or family in _SIGMOID_ROUTERS,
        expert_bias=family == "gpt_oss",
        shared_expert_gate=family == "qwen2_moe" and bool(shared_ffn),
        scoring="sigmoid" if family in _SIGMOID_ROUTERS else "softmax",
        norm_topk_prob=True if family == "mixtral" else r.bool("norm_topk_prob", _NORM_TOPK_DEFAULT.get(family, True)),
        routed_scaling=r.float("routed_scaling_factor", 1.0) if family in _SIGMOID_ROUTERS else 1.0,
        n_group=r.int("n_group", 1) if family in _SIGMOID_ROUTERS else 1,
        topk_group=r.int("topk_group", 1) if family in _SIGMOID_ROUTERS else 1,
    )


def _mla(r: _Reader) -> MLASpec | None:
    if not r.has("kv_lora_rank"):
        return None
    return MLASpec(q_lora_rank=r.int("q_lora_rank", 0, low=0), kv_lora_rank=r.int("kv_lora_rank"),
                   qk_nope_head_dim=r.int("qk_nope_head_dim", 0, low=0), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                   v_head_dim=r.int("v_head_dim"), rope_interleave=r.bool("rope_interleave", True))


def _sliding(r: _Reader, family: str, n_layers: int) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that use it) as each family's attention code applies sliding_window."""
    if family == "llama4_text":  # chunked local attention: 3 of every 4 layers, a window of one chunk
        chunk = r.int("attention_chunk_size", 0, low=0)
        return (chunk, tuple(i for i in range(n_layers) if (i + 1) % 4)) if chunk else (0, ())
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not r.bool("use_sliding_window", False):
        return 0, ()
    window = r.int("sliding_window", 0, low=0)
    if not window:
        return 0, ()
    if r.has("layer_types"):  # transformers 5 writes the kind of every layer
        types = r.data["layer_types"]
        if not isinstance(types, list) or len(types) != n_layers or not all(isinstance(t, str) for t in types):
            raise r.fail("layer_types", f"a list of {n_layers} attention kinds")
        return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if family in ("gpt_oss", "gemma2"):  # even layers slide, odd layers attend globally
        return window, tuple(range(0, n_layers, 2))
    first = r.int("max_window_layers", 28, low=0)  # Qwen2/Qwen3: layers from max_window_layers on slide
    if family in ("qwen2", "qwen3"):
        return window, tuple(range(first, n_layers))
    if family == "qwen2_moe":  # its config class: even layers below max_window_layers
        return window, tuple(i for i in range(min(first, n_layers)) if i % 2 == 0)
    return window, tuple(range(n_layers))


def _rope(r: _Reader, family: str, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling): transformers 5's `rope_parameters`, or 4.x's rope_theta + rope_scaling."""
    params = r.dict("rope_parameters")
    if params is not None and any(isinstance(v, dict) for v in params.values()):
        raise r.fail("rope_parameters", "one set of rope keys (per-layer-type rope is not read)")
    scaling = params if params is not None else r.dict("rope_scaling")
    inner = _Reader(scaling or {}, f"{r.source} ({'rope_parameters' if params is not None else 'rope_scaling'})")
    theta = inner.float("rope_theta", r.float("rope_theta", _THETA_DEFAULT.get(family, 10_000.0)))
    kind = inner.str("rope_type", inner.str("type", "default"))
    partial = r.float("partial_rotary_factor", inner.float("partial_rotary_factor", 1.0)) != 1.0
    if partial:  # rope on part of each head: read, and refused by the executor by this name
        kind = kind + "+partial_rotary"
    elif kind == "default" or scaling is None:
        return theta, None
    original = r.int("original_max_position_embeddings", inner.int("original_max_position_embeddings", 0, low=0),
                     low=0)
    factor = inner.float("factor", 0.0)
    if kind == "yarn" and not factor:  # DeepSeek: the context ratio when the factor is absent
        factor = max_pos / original if original else 1.0
    return theta, RopeScaling(
        kind=kind, factor=factor or 1.0, original_max_position=original,
        low_freq_factor=inner.float("low_freq_factor", 1.0), high_freq_factor=inner.float("high_freq_factor", 4.0),
        beta_fast=inner.float("beta_fast", 32.0), beta_slow=inner.float("beta_slow", 1.0),
        mscale=inner.float("mscale", 0.0), mscale_all_dim=inner.float("mscale_all_dim", 0.0),
        attention_factor=inner.float("attention_factor", 0.0), truncate=inner.bool("truncate", True))


def _activation(r: _Reader, key: str, default: str) -> str:
    name = r.str(key, default)
    if name not in _ACTIVATIONS:
        raise ModelError(f"{r.source}: {key} {name!r} is not an activation meshplan computes; it reads "
                         f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _from_llama_like(r: _Reader, name: str, family: str) -> ModelSpec:
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    n_layers = r.int("num_hidden_layers")
    kv = r.int("num_key_value_heads", heads)  # absent means multi-head attention
    mla = _mla(r)
    moe = _moe(r, family, n_layers)
    if mla is not None:
        head_dim = mla.qk_head_dim  # the width of one query-key dot product
    elif r.has("head_dim"):
        head_dim = r.int("head_dim")
    else:
        if hidden % heads:
            raise ModelError(f"{r.source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                             "add head_dim")
        head_dim = hidden // heads
    ffn_key = "intermediate_size_mlp" if family == "llama4_text" else "intermediate_size"
    if moe is not None and not r.has(ffn_key):
        ffn = moe.expert_ffn_hidden  # no dense layers: the dense width is never used
    else:
        ffn = r.int(ffn_key)
    window, sliding_ids = _sliding(r, family, n_layers)
    tied_default = family in _TIED_BY_DEFAULT
    attention_bias = r.bool("attention_bias", False)
    max_pos = r.int("max_position_embeddings", 4096)
    theta, scaling = _rope(r, family, max_pos)
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=heads if mla is not None else kv,
        head_dim=head_dim,
        ffn_hidden=ffn,
        vocab=r.int("vocab_size"),
        max_seq_len=max_pos,
        mlp="swiglu",  # every family read here gates its MLP (3 matrices) whatever hidden_act says
        norm="rmsnorm",
        position="rope",
        tie_embeddings=r.bool("tie_word_embeddings", tied_default),
        bias=attention_bias and r.bool("mlp_bias", False),
        dropout=r.float("attention_dropout", 0.0),
        moe=moe,
        mla=mla,
        qkv_bias=family in ("qwen2", "qwen2_moe"),
        attention_bias=attention_bias and not r.bool("mlp_bias", False),
        attention_sinks=family == "gpt_oss",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        norms_per_layer=4 if family in ("gemma2", "grok-1") else 2,
        sliding_window=window,
        sliding_layers=len(sliding_ids),
        mtp_layers=r.int("num_nextn_predict_layers", 0, low=0),
        glu_clamp=r.float("swiglu_limit", 0.0) if family == "gpt_oss" else 0.0,
        family=family,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=r.float("rms_norm_eps", _NORM_EPS_DEFAULT.get(family, 1e-6)),
        activation=_activation(r, "hidden_act", "silu"),
        sliding_layer_ids=sliding_ids if window else (),
    )


def _from_gpt2(r: _Reader, name: str) -> ModelSpec:
    hidden = r.int("n_embd")
    heads = r.int("n_head")
    if hidden % heads:
        raise ModelError(f"{r.source}: n_embd {hidden} is not a multiple of n_head {heads}")
    return ModelSpec(
        name=name,
        n_layers=r.int("n_layer"),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_hidden=r.int("n_inner", 4 * hidden),  # null means 4*n_embd
        vocab=r.int("vocab_size"),
        max_seq_len=r.int("n_positions", 0, low=0) or r.int("n_ctx", 1024),
        mlp="gelu",
        norm="layernorm",
        position="learned",
        tie_embeddings=r.bool("tie_word_embeddings", True),
        bias=True,
        dropout=r.float("resid_pdrop", 0.0),
        family="gpt2",
        norm_eps=r.float("layer_norm_epsilon", 1e-5),
        activation=_activation(r, "activation_function", "gelu_new"),
    )
