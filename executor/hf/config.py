"""config.json both ways: the --init-from directory's against the plan's model, and one written from a ModelSpec.

`check_config`: the directory's config.json is read by the planner's own
reader (planner.model.hf_config) and compared with plan.json's model field by
field (the name aside); any difference is refused before a rank starts,
naming each field with both values, since the weights would be loaded into
another model than the one planned.

`config_json`: a run that started from random weights has no config.json to
copy into its Hugging Face export, so one is written that transformers reads
back as the same model: the family the spec was read from, or for presets
the Hugging Face family whose modeling code computes it (a Llama-style dense
model: llama, mistral with a window on every layer, qwen2 with q/k/v biases,
qwen3 with q/k norms; mixtral for a softmax router without shared experts;
gpt2 for GPT-style layers). `tests/unit/test_hf_config.py` reads every
written config back with the planner's reader and gets the spec again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from planner.model.spec import ModelSpec
from topologies.errors import UsageError

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_config(spec: ModelSpec, directory: str | Path) -> None:
    """Refuse (UsageError, exit 2) a directory whose config.json describes another model than `spec`."""
    from planner.model.load import load_model

    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UsageError(f"--init-from {str(directory)!r} has no config.json (the default is plan.json's "
                         "weights_dir): give a Hugging Face model directory, or --init-from none for random weights")
    ours, theirs = _effective(spec).to_json(), _effective(load_model(str(path))).to_json()
    differ = [key for key in ours if key != "name" and ours[key] != theirs.get(key)]
    if differ:
        shown = "; ".join(f"{key}: plan {_short(ours[key])}, {path} {_short(theirs.get(key))}" for key in differ)
        raise UsageError(f"--init-from {directory}: its config.json describes another model than the plan's "
                         f"({shown}); re-plan with `meshplan plan --model {directory}`")


def _effective(spec: ModelSpec) -> ModelSpec:
    """What the spec computes, spelled one way: the MLP's own activation named, and a preset's family the one
    whose config.json it would be exported with (so a run exported from a preset reloads into its plan)."""
    family = spec.family
    if not family:
        try:
            family = _family(spec)
        except UsageError:
            family = ""
    return dataclasses.replace(spec, activation=spec.mlp_activation, family=family)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _family(spec: ModelSpec) -> str:
    """The Hugging Face family whose modeling code computes `spec` (see the module docstring)."""
    if spec.family:
        return spec.family
    if spec.norm == "layernorm" and spec.mlp == "gelu" and spec.position == "learned" and spec.bias \
            and spec.n_kv_heads == spec.n_heads and spec.tie_embeddings:
        return "gpt2"
    why = None
    if spec.norm != "rmsnorm" or spec.mlp != "swiglu" or spec.position != "rope":
        why = f"{spec.norm}, {spec.mlp}, {spec.position} positions"
    elif spec.mla is not None:
        why = "MLA without DeepSeek's router"
    elif spec.moe is not None:
        m = spec.moe
        if m.n_shared_experts or m.scoring != "softmax" or not m.norm_topk_prob or m.first_dense_layers \
                or m.layer_step != 1 or m.dense_layers or spec.qkv_bias or spec.qk_norm or spec.sliding_window:
            why = "a mixture of experts no single family computes (shared experts, dense layers or attention extras)"
        else:
            return "mixtral"
    elif sum((spec.qkv_bias, spec.qk_norm, bool(spec.sliding_window))) > 1:
        why = "more than one of q/k/v biases, q/k norms and a sliding window"
    elif spec.sliding_window and spec.sliding_layers != spec.n_layers:
        why = "a sliding window on some layers only"
    if why:
        raise UsageError(f"model {spec.name!r} has {why}: no Hugging Face family computes it, so there is no "
                         "config.json to export it with; export with --format torch")
    return "qwen2" if spec.qkv_bias else "qwen3" if spec.qk_norm else "mistral" if spec.sliding_window else "llama"


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "gpt2": "GPT2LMHeadModel"}
_ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_new", "gelu": "gelu"}


def _rope(spec: ModelSpec) -> dict[str, Any]:
    s = spec.rope_scaling
    params: dict[str, Any] = {"rope_type": "default" if s is None else s.kind, "rope_theta": spec.rope_theta}
    if s is not None:
        params.update(factor=s.factor, original_max_position_embeddings=s.original_max_position or spec.max_seq_len)
        if s.kind == "llama3":
            params.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        if s.kind == "yarn":
            params.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
            params.update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(s, k)})
    return params


def _gpt2(spec: ModelSpec) -> dict[str, Any]:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": spec.hidden,
            "n_layer": spec.n_layers, "n_head": spec.n_heads, "n_inner": spec.ffn_hidden, "vocab_size": spec.vocab,
            "n_positions": spec.max_seq_len, "layer_norm_epsilon": spec.norm_eps,
            "activation_function": _ACTIVATION_NAMES[spec.mlp_activation], "tie_word_embeddings": True,
            "resid_pdrop": spec.dropout, "embd_pdrop": spec.dropout, "attn_pdrop": spec.dropout}


def _moe(spec: ModelSpec, family: str) -> dict[str, Any]:
    m = spec.moe
    out: dict[str, Any] = {"num_experts_per_tok": m.top_k}
    if family == "mixtral":
        return {**out, "num_local_experts": m.n_experts}
    out.update(moe_intermediate_size=m.expert_ffn_hidden, norm_topk_prob=m.norm_topk_prob)
    if family == "deepseek_v3":
        return {**out, "n_routed_experts": m.n_experts, "n_shared_experts": m.n_shared_experts,
                "first_k_dense_replace": m.first_dense_layers, "routed_scaling_factor": m.routed_scaling,
                "n_group": m.n_group, "topk_group": m.topk_group, "topk_method": "noaux_tc"}
    out.update(num_experts=m.n_experts, decoder_sparse_step=m.layer_step, mlp_only_layers=list(m.dense_layers))
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = m.n_shared_experts * (m.shared_ffn_hidden or m.expert_ffn_hidden)
    return out


def config_json(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """A config.json transformers loads as `spec` (see the module docstring); dtype: fp32, bf16 or fp16."""
    family = _family(spec)
    if family not in _ARCHITECTURES:
        raise UsageError(f"model {spec.name!r} ({family}): meshplan does not write {family} configs")
    if family == "gpt2":
        out = _gpt2(spec)
    else:
        out = {"model_type": family, "architectures": [_ARCHITECTURES[family]], "hidden_size": spec.hidden,
               "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
               "num_key_value_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
               "intermediate_size": spec.ffn_hidden, "vocab_size": spec.vocab,
               "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps,
               "hidden_act": _ACTIVATION_NAMES[spec.mlp_activation], "tie_word_embeddings": spec.tie_embeddings,
               "attention_bias": spec.attention_bias, "attention_dropout": spec.dropout,
               "rope_parameters": _rope(spec)}
        if spec.mla is not None:
            m = spec.mla
            out.update(q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                       qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                       v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave)
            del out["head_dim"]
        if spec.moe is not None:
            out.update(_moe(spec, family))
        if spec.sliding_window:
            out.update(sliding_window=spec.sliding_window, use_sliding_window=True,
                       layer_types=["sliding_attention" if spec.window_of(i) else "full_attention"
                                    for i in range(spec.n_layers)])
    out["dtype"] = DTYPE_NAMES[dtype]
    return out


def with_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A source config.json with the export's dtype (transformers 5's `dtype`, 4.x's `torch_dtype`)."""
    out = dict(config)
    out["dtype"] = DTYPE_NAMES[dtype]
    if "torch_dtype" in out:
        out["torch_dtype"] = DTYPE_NAMES[dtype]
    return out


def same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Equal but for the name: what a written config must read back as."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")
