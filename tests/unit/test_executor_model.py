"""The executor's model: shapes agree with the planner's ModelSpec, math agrees with references.

Single-process unit tests; references are independent formulations (complex
rotation for RoPE, explicit softmax attention with repeated KV heads,
ModelSpec's closed-form parameter count).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from executor.model import (
    Attention,
    build_model,
    full_init_value,
    init_weights,
    rope_tables,
    rotate_half_apply,
)
from executor.parallel.pipeline import split_stage
from planner.layout import Layout
from planner.model.load import load_model
from planner.model.spec import ModelSpec
from planner.plan import with_stage_layers
from topologies.errors import ModelError

CPU = torch.device("cpu")


def _materialized(name: str, seed: int = 0):
    spec = load_model(name)
    model = build_model(spec)  # meta, as the executor builds it
    init_weights(model, spec, seed, CPU)
    return spec, model


@pytest.mark.parametrize("name", ["debug", "debug-gpt", "llama2-7b", "llama3-8b", "gpt3-175b"])
def test_parameter_count_matches_modelspec(name):
    """Our modules hold exactly the parameters the planner's memory model counts."""
    spec = load_model(name)
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.total_params


def test_tied_embeddings_survive_materialization():
    """to_empty from meta unties shared weights; init_weights must tie them again."""
    spec, model = _materialized("debug-gpt")
    assert spec.tie_embeddings
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())


def test_init_is_deterministic_and_seed_dependent():
    _, a = _materialized("debug", seed=3)
    _, b = _materialized("debug", seed=3)
    _, c = _materialized("debug", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.ndim >= 2:
            assert not torch.equal(pa, pc), name


def test_init_statistics():
    """Norms 1, N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 * n_layers) (GPT-2)."""
    spec = load_model("llama3.2-1b")
    w = full_init_value("layers.0.attention.wq.weight", (2048, 2048), spec, 0)
    wo = full_init_value("layers.0.attention.wo.weight", (2048, 2048), spec, 0)
    assert w.std().item() == pytest.approx(0.02, rel=0.01)
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(2 * spec.n_layers), rel=0.01)
    assert torch.equal(full_init_value("norm.weight", (8,), spec, 0), torch.ones(8))
    assert torch.equal(full_init_value("layers.1.ffn_norm.weight", (8,), spec, 0), torch.ones(8))


def test_rope_matches_complex_rotation():
    """Rotate-half RoPE == multiplying (x_i + i x_{i+d/2}) by exp(i p theta^(-2i/d))."""
    d, seq = 16, 12
    x = torch.randn(2, seq, 3, d)
    cos, sin = rope_tables(d, seq, "cpu")
    got = rotate_half_apply(x, cos, sin)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    freqs = 10_000.0 ** (-torch.arange(0, d, 2).float() / d)
    angle = torch.outer(torch.arange(seq).float(), freqs)[None, :, None, :]
    rot = z * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat((rot.real, rot.imag), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_matches_explicit_gqa():
    """Our attention == softmax(QK^T/sqrt(d) + causal mask) V with each KV head repeated a/k times."""
    spec = load_model("debug")  # 4 query heads, 2 KV heads
    torch.manual_seed(0)
    attn = Attention(spec)
    x = torch.randn(2, 10, spec.hidden)
    cos, sin = rope_tables(spec.head_dim, 10, "cpu")
    got = attn(x, cos, sin)
    b, s, d = 2, 10, spec.head_dim
    q = rotate_half_apply(attn.wq(x).view(b, s, -1, d), cos, sin).transpose(1, 2)
    k = rotate_half_apply(attn.wk(x).view(b, s, -1, d), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(b, s, -1, d).transpose(1, 2)
    rep = spec.n_heads // spec.n_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_changes_no_gradient(mode):
    from executor.parallel.parallelize import apply_ac

    _, ref = _materialized("debug")
    _, ac = _materialized("debug")
    apply_ac(ac, mode)
    x = torch.randint(0, 256, (2, 16))
    for model in (ref, ac):
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    for (name, p), q in zip(ref.named_parameters(), ac.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("layout", [
    Layout(pp=2, dp_replicate=2),
    Layout(pp=2, virtual_stages=2, pp_schedule="interleaved-1f1b", dp_replicate=2, grad_accum_steps=2),
    Layout(pp=4, layers_per_stage=(1, 1, 1, 1), grad_accum_steps=4),
])
def test_pipeline_stages_partition_the_names(layout):
    """Stages keep the single-process FQNs; together they hold every parameter exactly once."""
    spec = load_model("debug")
    layout = with_stage_layers(spec, layout)
    full = build_model(spec)
    names = set(dict(full.named_parameters()))
    held: list[str] = []
    for pp_rank in range(layout.pp):
        for stage in layout.stages_of(pp_rank):
            held += list(dict(split_stage(full, layout, stage).named_parameters()))
    assert sorted(held) == sorted(names)


def test_unsupported_models_are_refused():
    spec = load_model("debug")
    alibi = ModelSpec(**{**spec.to_json(), "position": "alibi", "moe": None})
    with pytest.raises(ModelError, match="alibi"):
        build_model(alibi)
