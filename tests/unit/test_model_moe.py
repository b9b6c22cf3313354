"""Mixture-of-experts and family-specific models from their published config.json files.

The fixtures under tests/data/hf_configs/ are the architecture keys of the
released config.json files. Published counts are the model cards' and papers':
DeepSeek-V3 README ("671B total, 36.6B activated including the 0.9B output
head"), DeepSeek-V2 paper (236B / 21B), Kimi-K2 card and tech report (1T,
1.04T / 32B), Qwen3 cards (235B / 22B, 30.5B / 3.3B), Qwen2 report (57.4B /
14B), gpt-oss model card table 1 (116.83B / 5.13B, 20.91B / 3.61B; active
without the embedding table), Mixtral paper and announcements (46.7B / 12.9B,
141B / 39B), Grok-1 README (314B).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.model.load import load_model
from planner.model.spec import ModelSpec, MoESpec
from topologies.errors import ModelError

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"

# file, published total (B), published active (B; a string where it is printed to fewer digits than
# 1% needs), whether the publisher counts the embedding table as active
PUBLISHED = [
    ("deepseek-v3", 671.0, 36.6, False),
    ("deepseek-v2", 236.0, 21.0, False),
    ("qwen3-235b-a22b", 235.0, 22.0, True),
    ("qwen3-30b-a3b", 30.5, "3.3", True),
    ("qwen2-57b-a14b", 57.4, "14", True),
    ("gpt-oss-120b", 116.83, 5.13, False),
    ("gpt-oss-20b", 20.91, 3.61, False),
    ("mixtral-8x7b", 46.7, 12.9, True),
    ("mixtral-8x22b", 141.0, 39.0, True),
    ("grok-1", 314.0, None, True),
]


def _truncates_to(value: float, published: str) -> bool:
    """Qwen prints 3.35B active as "3.3B" and 14.25B as "A14B": the value cut to the printed digits."""
    digits = len(published.split(".")[1]) if "." in published else 0
    return f"{int(value * 10**digits) / 10**digits:.{digits}f}" == published


@pytest.mark.parametrize("name, total_b, active_b, embedding_active", PUBLISHED)
def test_moe_configs_match_published_counts(name, total_b, active_b, embedding_active):
    m = load_model(str(CONFIGS / f"{name}.json"))
    assert m.moe is not None
    assert m.total_params / 1e9 == pytest.approx(total_b, rel=0.01)
    if active_b is not None:
        active = (m.active_params - (0 if embedding_active else m.embedding_params)) / 1e9
        if isinstance(active_b, str):  # printed with fewer digits than 1% needs
            assert _truncates_to(active, active_b)
        else:
            assert active == pytest.approx(active_b, rel=0.01)


def test_kimi_k2_between_its_two_published_totals():
    """The card says 1T, the tech report 1.04T; the config's arithmetic gives 1.026T."""
    m = load_model(str(CONFIGS / "kimi-k2-instruct.json"))
    assert 1.0e12 < m.total_params < 1.04e12
    assert m.total_params / 1.04e12 == pytest.approx(1.0, rel=0.015)
    assert (m.active_params - m.embedding_params) / 1e9 == pytest.approx(32.0, rel=0.01)


def test_deepseek_v3_structure():
    m = load_model(str(CONFIGS / "deepseek-v3.json"))
    assert m.mla is not None and m.mla.kv_lora_rank == 512 and m.head_dim == 192
    assert m.n_moe_layers == 58 and m.moe.first_dense_layers == 3 and m.moe.router_bias
    # README_WEIGHTS: the MTP module is 11.5B unique parameters
    assert m.mtp_layers == 1 and m.mtp_params / 1e9 == pytest.approx(11.5, rel=0.02)


def test_llama4_maverick_interleaves_moe_and_dense_layers():
    m = load_model(str(CONFIGS / "llama-4-maverick-17b-128e.json"))
    assert m.n_moe_layers == 24 and m.ffn_hidden == 16384 and m.moe.n_shared_experts == 1
    assert [i for i in range(4) if m.moe.is_moe_layer(i)] == [1, 3]
    assert load_model(str(CONFIGS / "llama-4-scout-17b-16e.json")).n_moe_layers == 48


def test_gpt_oss_sliding_layers_sinks_and_biases():
    m = load_model(str(CONFIGS / "gpt-oss-20b.json"))
    assert (m.sliding_window, m.sliding_layers) == (128, 12)
    assert m.attention_sinks and m.attention_bias and m.moe.router_bias and m.moe.expert_bias
    assert m.glu_clamp == 7.0 and load_model("gpt-oss-120b").glu_clamp == 7.0  # config.json swiglu_limit
    assert load_model("qwen3-30b-a3b").glu_clamp == 0.0
    with pytest.raises(ModelError, match="glu_clamp"):
        ModelSpec.from_json({**m.to_json(), "glu_clamp": -7.0})
    full = ModelSpec.from_json({**m.to_json(), "sliding_window": 0, "sliding_layers": 0,
                                  "sliding_layer_ids": []})
    # half the layers see 128 keys instead of 4096
    assert m.attention_flops_per_token(4096) / full.attention_flops_per_token(4096) == pytest.approx((4096 + 128) / 8192)


def test_presets_equal_their_configs():
    for preset, file in (("deepseek-v3", "deepseek-v3"), ("qwen3-30b-a3b", "qwen3-30b-a3b"),
                         ("gpt-oss-120b", "gpt-oss-120b"), ("grok-1", "grok-1"),
                         ("llama4-maverick", "llama-4-maverick-17b-128e"), ("kimi-k2", "kimi-k2-instruct")):
        a, b = load_model(preset), load_model(str(CONFIGS / f"{file}.json"))
        assert (a.total_params, a.active_params) == (b.total_params, b.active_params), preset


@pytest.mark.parametrize("file, total_b", [("llama-3.1-8b", 8.03), ("llama-3.1-405b", 405.85), ("qwen2.5-7b", 7.61),
                                           ("qwen2.5-72b", 72.7), ("gemma-2-9b", 9.24), ("gemma-2-27b", 27.2),
                                           ("gpt-2", 0.1244), ("phi-3-mini-4k", 3.82)])
def test_dense_configs_match_published_counts(file, total_b):
    assert load_model(str(CONFIGS / f"{file}.json")).total_params / 1e9 == pytest.approx(total_b, rel=0.01)


def test_gemma2_ties_embeddings_when_the_key_is_absent(tmp_path):
    cfg = json.loads((CONFIGS / "gemma-2-27b.json").read_text())
    del cfg["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))  # a snapshot directory
    assert m.tie_embeddings and m.total_params / 1e9 == pytest.approx(27.2, rel=0.01)


def test_qwen2_reads_its_qkv_bias():
    m = load_model(str(CONFIGS / "qwen2.5-7b.json"))
    assert m.qkv_bias and not m.bias
    q, kv = m.q_dim, m.kv_dim
    without = ModelSpec.from_json({**m.to_json(), "qkv_bias": False})
    assert m.total_params - without.total_params == m.n_layers * (q + 2 * kv)


def _write(tmp_path, **changes) -> str:
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg) if "raw" not in changes else changes["raw"])
    return str(path)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_attention_heads", None),
                                        ("hidden_size", "4096"), ("hidden_size", [4096]), ("hidden_size", 4096.5),
                                        ("num_hidden_layers", True), ("vocab_size", -1),
                                        ("tie_word_embeddings", "yes")])
def test_bad_values_name_file_key_and_value(tmp_path, key, value):
    path = _write(tmp_path, **{key: value})
    with pytest.raises(ModelError) as err:
        load_model(path)
    assert path in str(err.value) and key in str(err.value)


def test_huge_and_nan_numbers_are_refused(tmp_path):
    path = tmp_path / "config.json"
    for text in ('{"model_type": "llama", "hidden_size": 1e400}', '{"model_type": "llama", "hidden_size": NaN}'):
        path.write_text(text)
        with pytest.raises(ModelError, match="hidden_size|NaN"):
            load_model(str(path))


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes("{}".encode("utf-16"))
    with pytest.raises(ModelError, match="UTF-8"):
        load_model(str(path))


@pytest.mark.parametrize("changes", [{"model_type": "mamba"}, {"model_type": None, "architectures": ["MambaForCausalLM"]},
                                     {"model_type": "clip"}])
def test_unknown_architectures_are_refused_with_the_supported_list(tmp_path, changes):
    with pytest.raises(ModelError, match="not a supported architecture.*deepseek_v3.*gpt_oss"):
        load_model(_write(tmp_path, **changes))


def test_old_moe_block_still_loads():
    old = {"name": "old", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16,
           "ffn_hidden": 128, "vocab": 256, "max_seq_len": 256,
           "moe": {"n_experts": 8, "top_k": 2, "expert_ffn_hidden": 128, "n_shared_experts": 0, "shared_ffn_hidden": 0}}
    m = ModelSpec.from_json(old)
    assert m.n_moe_layers == 4 and m.moe == MoESpec(n_experts=8, top_k=2, expert_ffn_hidden=128)
    assert ModelSpec.from_json(json.loads(json.dumps(load_model("deepseek-v3").to_json()))) == load_model("deepseek-v3")
    with pytest.raises(ModelError, match="moe"):
        ModelSpec.from_json({**old, "moe": "yes"})
