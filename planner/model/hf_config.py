"""Hugging Face config.json -> ModelSpec.

Reads the keys Llama, Mistral, Qwen2, Mixtral and Qwen-MoE configs use, and
GPT-2's older names. Unknown keys are ignored; a missing required key is an
error that names it.
"""

from __future__ import annotations

from typing import Any

from planner.model.spec import ModelSpec, MoESpec
from topologies.errors import ModelError

_LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads")
_GPT2_KEYS = ("n_embd", "n_layer", "n_head")


def is_hf_config(data: dict[str, Any]) -> bool:
    """True when the JSON looks like a Hugging Face config rather than a ModelSpec."""
    return any(k in data for k in _LLAMA_KEYS + _GPT2_KEYS + ("model_type", "architectures"))


def _require(data: dict[str, Any], keys: tuple[str, ...], kind: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise ModelError(f"{kind} config.json is missing required keys: {', '.join(missing)}")


def model_from_hf_config(data: dict[str, Any], default_name: str = "hf-model") -> ModelSpec:
    name = str(data.get("_name_or_path") or data.get("model_type") or default_name) or default_name
    if "n_embd" in data or data.get("model_type") == "gpt2":
        return _from_gpt2(data, name)
    return _from_llama_like(data, name)


def _from_llama_like(data: dict[str, Any], name: str) -> ModelSpec:
    _require(data, _LLAMA_KEYS + ("vocab_size",), "Llama-style")
    hidden = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    kv = data.get("num_key_value_heads")
    head_dim = data.get("head_dim") or hidden // heads
    n_experts = data.get("num_local_experts") or data.get("num_experts")
    moe = None
    if n_experts:
        expert_ffn = data.get("moe_intermediate_size") or data.get("intermediate_size")
        if not expert_ffn:
            raise ModelError("MoE config.json needs moe_intermediate_size or intermediate_size")
        shared_ffn = int(data.get("shared_expert_intermediate_size") or 0)
        n_shared = int(data.get("n_shared_experts") or (1 if shared_ffn else 0))
        moe = MoESpec(
            n_experts=int(n_experts),
            top_k=int(data.get("num_experts_per_tok") or 2),
            expert_ffn_hidden=int(expert_ffn),
            n_shared_experts=n_shared,
            shared_ffn_hidden=shared_ffn,
        )
    ffn = data.get("intermediate_size") or (moe.expert_ffn_hidden if moe else None)
    if not ffn:
        raise ModelError("Llama-style config.json is missing required key: intermediate_size")
    return ModelSpec(
        name=name,
        n_layers=int(data["num_hidden_layers"]),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=int(kv) if kv else heads,  # absent means multi-head attention
        head_dim=int(head_dim),
        ffn_hidden=int(ffn),
        vocab=int(data["vocab_size"]),
        max_seq_len=int(data.get("max_position_embeddings") or 4096),
        mlp="swiglu",  # Llama-family MLPs are gated (3 matrices) whatever hidden_act says
        norm="rmsnorm",
        position="rope",
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        bias=bool(data.get("attention_bias", False)) and bool(data.get("mlp_bias", False)),
        dropout=float(data.get("attention_dropout", 0.0) or 0.0),
        moe=moe,
    )


def _from_gpt2(data: dict[str, Any], name: str) -> ModelSpec:
    _require(data, _GPT2_KEYS + ("vocab_size",), "GPT-2")
    hidden = int(data["n_embd"])
    heads = int(data["n_head"])
    inner = data.get("n_inner")
    return ModelSpec(
        name=name,
        n_layers=int(data["n_layer"]),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_hidden=int(inner) if inner else 4 * hidden,  # null means 4*n_embd
        vocab=int(data["vocab_size"]),
        max_seq_len=int(data.get("n_positions") or data.get("n_ctx") or 1024),
        mlp="gelu",
        norm="layernorm",
        position="learned",
        tie_embeddings=bool(data.get("tie_word_embeddings", True)),
        bias=True,
        dropout=float(data.get("resid_pdrop", 0.0) or 0.0),
    )
