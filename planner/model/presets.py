"""Named model presets and the size aliases `--model 13B` resolves to.

Shapes are taken from each model's published configuration (paper or released
config.json); the parameter counts they imply are pinned in tests/unit/test_model.py
and tests/unit/test_model_moe.py. The mixture-of-experts presets are the
architecture keys of each released config.json, read by the same code as a
user's file (planner.model.hf_config), so a preset and its config agree.
"""

from __future__ import annotations

from planner.model.hf_config import model_from_hf_config
from planner.model.spec import ModelSpec, MoESpec, RopeScaling


def _llama(name, layers, hidden, heads, kv, ffn, vocab, ctx, tie=False, theta=10_000.0, scaling=None) -> ModelSpec:
    """A Llama of the released config: rms_norm_eps 1e-5 in every Llama 2/3 release; theta and rope scaling
    as each one's config.json (Llama 3: 500k; 3.1/3.2: llama3 scaling from 8192 positions; Code Llama: 1M)."""
    return ModelSpec(
        name=name, n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=kv,
        head_dim=hidden // heads, ffn_hidden=ffn, vocab=vocab, max_seq_len=ctx,
        mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=tie,
        family="llama", rope_theta=theta, norm_eps=1e-5,
        rope_scaling=None if scaling is None else RopeScaling(kind="llama3", factor=scaling,
                                                              original_max_position=8192),
    )



def _gpt(name, layers, hidden, heads, vocab, ctx, position="learned") -> ModelSpec:
    return ModelSpec(
        name=name, n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=heads,
        head_dim=hidden // heads, ffn_hidden=4 * hidden, vocab=vocab, max_seq_len=ctx,
        mlp="gelu", norm="layernorm", position=position, tie_embeddings=True, bias=True,
    )


def _hf(name: str, config: dict) -> ModelSpec:
    return model_from_hf_config(config, default_name=name, source=f"preset {name}")


# Released config.json architecture keys (hub repos: deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2,
# moonshotai/Kimi-K2-Instruct, Qwen/Qwen3-235B-A22B, Qwen/Qwen3-30B-A3B, Qwen/Qwen2-57B-A14B,
# openai/gpt-oss-120b and -20b, mistralai/Mixtral-8x22B-v0.1, xai-org/grok-1 (its run.py, in HF names),
# meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E text_config).
_MOE = [
    _hf("deepseek-v3", {'model_type': 'deepseek_v3', 'hidden_size': 7168, 'num_hidden_layers': 61, 'num_attention_heads': 128, 'intermediate_size': 18432, 'vocab_size': 129280, 'n_routed_experts': 256, 'n_shared_experts': 1, 'num_experts_per_tok': 8, 'moe_intermediate_size': 2048, 'first_k_dense_replace': 3, 'moe_layer_freq': 1, 'q_lora_rank': 1536, 'kv_lora_rank': 512, 'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64, 'v_head_dim': 128, 'num_nextn_predict_layers': 1, 'topk_method': 'noaux_tc', 'max_position_embeddings': 163840, 'rope_scaling': {'type': 'yarn', 'factor': 40, 'original_max_position_embeddings': 4096}}),
    _hf("deepseek-v2", {'model_type': 'deepseek_v2', 'hidden_size': 5120, 'num_hidden_layers': 60, 'num_attention_heads': 128, 'intermediate_size': 12288, 'vocab_size': 102400, 'n_routed_experts': 160, 'n_shared_experts': 2, 'num_experts_per_tok': 6, 'moe_intermediate_size': 1536, 'first_k_dense_replace': 1, 'moe_layer_freq': 1, 'q_lora_rank': 1536, 'kv_lora_rank': 512, 'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64, 'v_head_dim': 128, 'topk_method': 'group_limited_greedy', 'max_position_embeddings': 163840}),
    _hf("kimi-k2", {'model_type': 'kimi_k2', 'hidden_size': 7168, 'num_hidden_layers': 61, 'num_attention_heads': 64, 'intermediate_size': 18432, 'vocab_size': 163840, 'n_routed_experts': 384, 'n_shared_experts': 1, 'num_experts_per_tok': 8, 'moe_intermediate_size': 2048, 'first_k_dense_replace': 1, 'moe_layer_freq': 1, 'q_lora_rank': 1536, 'kv_lora_rank': 512, 'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64, 'v_head_dim': 128, 'num_nextn_predict_layers': 0, 'topk_method': 'noaux_tc', 'max_position_embeddings': 131072}),
    _hf("qwen3-235b-a22b", {'model_type': 'qwen3_moe', 'hidden_size': 4096, 'num_hidden_layers': 94, 'num_attention_heads': 64, 'num_key_value_heads': 4, 'head_dim': 128, 'intermediate_size': 12288, 'vocab_size': 151936, 'num_experts_per_tok': 8, 'moe_intermediate_size': 1536, 'num_experts': 128, 'decoder_sparse_step': 1, 'max_position_embeddings': 40960}),
    _hf("qwen3-30b-a3b", {'model_type': 'qwen3_moe', 'hidden_size': 2048, 'num_hidden_layers': 48, 'num_attention_heads': 32, 'num_key_value_heads': 4, 'head_dim': 128, 'intermediate_size': 6144, 'vocab_size': 151936, 'num_experts_per_tok': 8, 'moe_intermediate_size': 768, 'num_experts': 128, 'decoder_sparse_step': 1, 'max_position_embeddings': 40960}),
    _hf("qwen2-57b-a14b", {'model_type': 'qwen2_moe', 'hidden_size': 3584, 'num_hidden_layers': 28, 'num_attention_heads': 28, 'num_key_value_heads': 4, 'intermediate_size': 18944, 'vocab_size': 151936, 'num_experts': 64, 'num_experts_per_tok': 8, 'moe_intermediate_size': 2560, 'shared_expert_intermediate_size': 20480, 'decoder_sparse_step': 1, 'max_position_embeddings': 131072}),
    _hf("gpt-oss-120b", {'model_type': 'gpt_oss', 'hidden_size': 2880, 'num_hidden_layers': 36, 'num_attention_heads': 64, 'num_key_value_heads': 8, 'head_dim': 64, 'intermediate_size': 2880, 'vocab_size': 201088, 'num_experts_per_tok': 4, 'num_local_experts': 128, 'sliding_window': 128, 'swiglu_limit': 7.0, 'attention_bias': True, 'max_position_embeddings': 131072}),
    _hf("gpt-oss-20b", {'model_type': 'gpt_oss', 'hidden_size': 2880, 'num_hidden_layers': 24, 'num_attention_heads': 64, 'num_key_value_heads': 8, 'head_dim': 64, 'intermediate_size': 2880, 'vocab_size': 201088, 'num_experts_per_tok': 4, 'num_local_experts': 32, 'sliding_window': 128, 'swiglu_limit': 7.0, 'attention_bias': True, 'max_position_embeddings': 131072}),
    _hf("mixtral-8x22b", {'model_type': 'mixtral', 'hidden_size': 6144, 'num_hidden_layers': 56, 'num_attention_heads': 48, 'num_key_value_heads': 8, 'intermediate_size': 16384, 'vocab_size': 32000, 'num_local_experts': 8, 'num_experts_per_tok': 2, 'max_position_embeddings': 65536}),
    _hf("grok-1", {'model_type': 'grok-1', 'hidden_size': 6144, 'num_hidden_layers': 64, 'num_attention_heads': 48, 'num_key_value_heads': 8, 'head_dim': 128, 'vocab_size': 131072, 'num_local_experts': 8, 'num_experts_per_tok': 2, 'intermediate_size': 32768, 'max_position_embeddings': 8192, 'tie_word_embeddings': True}),
    _hf("llama4-scout", {'model_type': 'llama4_text', 'hidden_size': 5120, 'num_hidden_layers': 48, 'num_attention_heads': 40, 'num_key_value_heads': 8, 'head_dim': 128, 'intermediate_size': 8192, 'vocab_size': 202048, 'num_experts_per_tok': 1, 'num_local_experts': 16, 'interleave_moe_layer_step': 1, 'intermediate_size_mlp': 16384, 'attention_chunk_size': 8192, 'max_position_embeddings': 10485760}),
    _hf("llama4-maverick", {'model_type': 'llama4_text', 'hidden_size': 5120, 'num_hidden_layers': 48, 'num_attention_heads': 40, 'num_key_value_heads': 8, 'head_dim': 128, 'intermediate_size': 8192, 'vocab_size': 202048, 'num_experts_per_tok': 1, 'num_local_experts': 128, 'interleave_moe_layer_step': 2, 'intermediate_size_mlp': 16384, 'attention_chunk_size': 8192, 'max_position_embeddings': 1048576}),
]

_ALL = [
    # Llama 2 (Touvron et al. 2023, table 1 and released configs).
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Code Llama 34B (Llama 2 architecture with GQA).
    _llama("codellama-34b", 48, 8192, 64, 8, 22016, 32000, 16384, theta=1e6),
    # Llama 3 / 3.1 / 3.2 (Dubey et al. 2024, table 3 and released configs).
    _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 131072, tie=True, theta=5e5, scaling=32.0),
    _llama("llama3.2-3b", 28, 3072, 24, 8, 8192, 128256, 131072, tie=True, theta=5e5, scaling=32.0),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, theta=5e5),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, theta=5e5),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 131072, theta=5e5, scaling=8.0),
    # GPT-3 175B (Brown et al. 2020, table 2.1), GPT-2 vocabulary.
    _gpt("gpt3-175b", 96, 12288, 96, 50257, 2048),
    # Megatron-LM's 1T configuration (Narayanan et al. 2021, table 1).
    _gpt("gpt-1t", 128, 25600, 160, 51200, 2048),
    # BLOOM 176B (BigScience 2022): ALiBi positions, GPT-style blocks, 250k vocabulary.
    _gpt("bloom-176b", 70, 14336, 112, 250880, 2048, position="alibi"),
    # Mixtral 8x7B (Jiang et al. 2024): Mistral 7B blocks with 8 experts, top-2.
    ModelSpec(
        name="mixtral-8x7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_hidden=14336, vocab=32000, max_seq_len=32768,
        moe=MoESpec(n_experts=8, top_k=2, expert_ffn_hidden=14336),
        family="mixtral", rope_theta=1e6, norm_eps=1e-5,
    ),
    *_MOE,
    # A tiny Llama-style model for tests: 4 layers so PP 2 has 2 layers a stage,
    # GQA (2 KV heads) so TP 2 still divides every head count.
    ModelSpec(
        name="debug", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
        ffn_hidden=128, vocab=256, max_seq_len=256,
    ),
    # Its GPT-style sibling: LayerNorm, learned positions, GELU, tied embeddings, biases.
    ModelSpec(
        name="debug-gpt", n_layers=4, hidden=64, n_heads=4, n_kv_heads=4, head_dim=16,
        ffn_hidden=256, vocab=256, max_seq_len=256, mlp="gelu", norm="layernorm",
        position="learned", tie_embeddings=True, bias=True,
    ),
    # Its mixture-of-experts sibling: 4 routed experts (top 2) and one shared expert per layer,
    # so ep 2 and ep 4 both divide the experts.
    ModelSpec(
        name="debug-moe", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
        ffn_hidden=128, vocab=256, max_seq_len=256,
        moe=MoESpec(n_experts=4, top_k=2, expert_ffn_hidden=64, n_shared_experts=1),
    ),
]

PRESETS: dict[str, ModelSpec] = {m.name: m for m in _ALL}

# `--model 13B`: the well-known architecture people mean by each size.
SIZE_ALIASES: dict[str, str] = {
    "1B": "llama3.2-1b",
    "3B": "llama3.2-3b",
    "7B": "llama2-7b",
    "8B": "llama3-8b",
    "13B": "llama2-13b",
    "34B": "codellama-34b",
    "70B": "llama3-70b",
    "175B": "gpt3-175b",
    "176B": "bloom-176b",
    "405B": "llama3-405b",
    "1T": "gpt-1t",
    "671B": "deepseek-v3",
}


def preset_names() -> list[str]:
    return list(PRESETS)
