"""ModelSpec: published parameter counts, Megatron's formula, config parsing."""

from __future__ import annotations

import json

import pytest

from planner.model.load import load_model
from planner.model.spec import ModelSpec
from topologies.errors import ModelError


@pytest.mark.parametrize(
    "name, published_billions, tol",
    [
        ("llama2-7b", 6.74, 0.005),
        ("llama2-13b", 13.0, 0.02),
        ("llama2-70b", 68.98, 0.01),
        ("llama3-8b", 8.03, 0.005),
        ("llama3-70b", 70.55, 0.01),
        ("llama3-405b", 405.85, 0.01),
        ("gpt3-175b", 174.6, 0.05),
        ("bloom-176b", 176.2, 0.1),
        ("mixtral-8x7b", 46.7, 0.05),
        ("llama3.2-1b", 1.24, 0.005),
    ],
)
def test_published_parameter_counts(name, published_billions, tol):
    assert load_model(name).total_params / 1e9 == pytest.approx(published_billions, abs=tol)


def test_mixtral_active_parameters():
    assert load_model("mixtral-8x7b").active_params / 1e9 == pytest.approx(12.9, abs=0.05)


@pytest.mark.parametrize("layers, hidden, heads, vocab, seq", [(96, 12288, 96, 50257, 2048), (24, 1024, 16, 50257, 1024),
                                                               (40, 5120, 40, 51200, 2048)])
def test_megatron_parameter_formula(layers, hidden, heads, vocab, seq):
    gpt = ModelSpec(name="gpt", n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=heads,
                    head_dim=hidden // heads, ffn_hidden=4 * hidden, vocab=vocab, max_seq_len=seq, mlp="gelu",
                    norm="layernorm", position="learned", tie_embeddings=True, bias=True)
    n, h = layers, hidden
    megatron = 12 * n * h**2 * (1 + 13 / (12 * h) + (vocab + seq) / (12 * n * h))
    # Megatron's formula leaves out the final LayerNorm (2h parameters).
    assert gpt.total_params - 2 * h == pytest.approx(megatron, rel=1e-12)


def test_size_aliases_resolve():
    assert load_model("13B").name == "llama2-13b"
    assert load_model("70b").name == "llama3-70b"
    assert load_model("405B").name == "llama3-405b"


def test_flops_per_token_matches_6n_plus_attention():
    m = load_model("gpt3-175b")
    s = 2048
    # Narayanan et al. 2021, appendix: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) FLOPs an iteration without
    # recomputation and 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) with full recomputation; B*s tokens.
    n, h, v = m.n_layers, m.hidden, m.vocab
    megatron = 72 * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    megatron_full = 96 * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))
    assert m.model_flops_per_token(s) == pytest.approx(megatron, rel=0.005)
    assert m.training_flops_per_token(s, "full") == pytest.approx(megatron_full, rel=0.005)
    assert m.training_flops_per_token(s, "none") < m.training_flops_per_token(s, "selective")
    assert m.training_flops_per_token(s, "selective") < m.training_flops_per_token(s, "full")


def test_hf_llama_config(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "rope_theta": 500000.0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert m.total_params == load_model("llama3-8b").total_params
    assert m.n_kv_heads == 8 and m.head_dim == 128


def test_hf_mha_default_and_head_dim_wins(tmp_path):
    cfg = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2, "num_attention_heads": 16,
           "vocab_size": 1000, "head_dim": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert m.n_kv_heads == 16 and m.head_dim == 256


def test_hf_mixtral_and_qwen_moe(tmp_path):
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2, "max_position_embeddings": 32768}
    (tmp_path / "mixtral.json").write_text(json.dumps(mixtral))
    m = load_model(str(tmp_path / "mixtral.json"))
    assert m.total_params == load_model("mixtral-8x7b").total_params
    qwen = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4}
    (tmp_path / "qwen.json").write_text(json.dumps(qwen))
    q = load_model(str(tmp_path / "qwen.json"))
    assert q.moe.n_experts == 60 and q.moe.expert_ffn_hidden == 1408 and q.moe.n_shared_experts == 1
    # Qwen1.5-MoE-A2.7B: 14.3B total parameters.
    assert q.total_params / 1e9 == pytest.approx(14.3, abs=0.1)


def test_hf_gpt2_config(tmp_path):
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "n_positions": 1024,
           "vocab_size": 50257, "activation_function": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    # GPT-2 small: 124.4M parameters with tied embeddings.
    assert m.total_params / 1e6 == pytest.approx(124.4, abs=0.1)
    assert m.ffn_hidden == 4 * 768


def test_missing_keys_are_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(ModelError, match="num_attention_heads"):
        load_model(str(path))


def test_unknown_model_suggests_nearest():
    with pytest.raises(ModelError, match="llama2-13b"):
        load_model("llama2-31b")


def test_own_json_roundtrip(tmp_path):
    m = load_model("mixtral-8x7b")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m.to_json()))
    assert load_model(str(path)) == m
