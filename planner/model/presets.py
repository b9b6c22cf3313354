"""Named model presets and the size aliases `--model 13B` resolves to.

Shapes are taken from each model's published configuration (paper or released
config.json); the parameter counts they imply are pinned in tests/test_model.py.
"""

from __future__ import annotations

from planner.model.spec import ModelSpec, MoESpec


def _llama(name, layers, hidden, heads, kv, ffn, vocab, ctx, tie=False) -> ModelSpec:
    return ModelSpec(
        name=name, n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=kv,
        head_dim=hidden // heads, ffn_hidden=ffn, vocab=vocab, max_seq_len=ctx,
        mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=tie,
    )


def _gpt(name, layers, hidden, heads, vocab, ctx, position="learned") -> ModelSpec:
    return ModelSpec(
        name=name, n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=heads,
        head_dim=hidden // heads, ffn_hidden=4 * hidden, vocab=vocab, max_seq_len=ctx,
        mlp="gelu", norm="layernorm", position=position, tie_embeddings=True, bias=True,
    )


_ALL = [
    # Llama 2 (Touvron et al. 2023, table 1 and released configs).
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Code Llama 34B (Llama 2 architecture with GQA).
    _llama("codellama-34b", 48, 8192, 64, 8, 22016, 32000, 16384),
    # Llama 3 / 3.1 / 3.2 (Dubey et al. 2024, table 3 and released configs).
    _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 131072, tie=True),
    _llama("llama3.2-3b", 28, 3072, 24, 8, 8192, 128256, 131072, tie=True),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 131072),
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
    ),
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
}


def preset_names() -> list[str]:
    return list(PRESETS)
