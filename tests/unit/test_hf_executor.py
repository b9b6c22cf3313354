"""executor.hf and the model features it loads, in one process without transformers (tests/consumers compares
with transformers itself): safetensors reads against the safetensors package, adapters both ways for every
family, config.json written and read back, each rank's shard against distribute_tensor, sliding windows and
routers against plain reference formulations."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.hf.adapter import export_rules
from executor.hf.config import check_config, config_json
from executor.hf.files import INDEX, WeightsDir, write_index, write_shard
from executor.hf.load import check_weights, load_part, local_value, state_tensors
from executor.model import build_model, init_weights
from executor.parallel.context import ContextShard, attend_gathered, shard_sequence
from executor.rope import inv_freq_and_factor
from planner.model.hf_config import model_from_hf_config
from planner.model.load import load_model
from planner.model.spec import ModelSpec, MoESpec, RopeScaling
from topologies.errors import UsageError

CPU = torch.device("cpu")
BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}
MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
CONFIGS = {
    "llama3": {**BASE, "model_type": "llama", "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "llama-bias": {**BASE, "model_type": "llama", "attention_bias": True},
    "mistral": {**BASE, "model_type": "mistral", "sliding_window": 16},
    "qwen2-tied": {**BASE, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 32},
    "mixtral": {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3-moe": {**BASE, **MOE, "model_type": "qwen3_moe", "norm_topk_prob": True},
    "qwen2-moe": {**BASE, **MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48},
    "deepseek-v3": {**BASE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                    "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 1,
                    "routed_scaling_factor": 2.5},
    "deepseek-v3-no-q-lora": {**BASE, "model_type": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": None,
                              "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                              "first_k_dense_replace": 1, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                              "qk_rope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 1},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 128},
}


def spec_of(name: str) -> ModelSpec:
    return model_from_hf_config(CONFIGS[name], default_name=name)


def random_model(spec: ModelSpec, seed: int = 0):
    model = build_model(spec)
    init_weights(model, spec, seed, CPU)
    with torch.no_grad():  # norms and score biases away from their constant initial values
        for name, t in state_tensors(model):
            if t.ndim == 1:
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def write_hf(model, spec: ModelSpec, directory, shard_every: int = 0) -> dict[str, torch.Tensor]:
    """Our model as a Hugging Face directory through the export rules (several shards when shard_every)."""
    ours = dict(state_tensors(model))
    if spec.tie_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    tensors = {}
    for rule in export_rules(spec):
        tensors.update(rule.save({n: ours[n].detach() for n in rule.ours}))
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_json(spec, "fp32")))
    if not shard_every:
        write_shard(directory / "model.safetensors", tensors)
        return tensors
    keys = sorted(tensors)
    groups = [keys[i:i + shard_every] for i in range(0, len(keys), shard_every)]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for group, name in zip(groups, names, strict=True):
        write_shard(directory / name, {k: tensors[k] for k in group})
    write_index(directory, {k: n for g, n in zip(groups, names, strict=True) for k in g}, 0)
    return tensors


# ---- files --------------------------------------------------------------------------------


def test_reads_whole_tensors_and_row_ranges_as_safetensors_stores_them(tmp_path):
    tensors = {"a": torch.randn(7, 5), "b": torch.randn(4, 3, 2).to(torch.bfloat16), "c": torch.arange(6)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = WeightsDir(tmp_path)
    for key, t in tensors.items():
        assert torch.equal(w.read(key), t) and w.read(key).dtype == t.dtype
    assert torch.equal(w.read("a", (2, 5)), tensors["a"][2:5])
    assert torch.equal(w.read("b", (3, 4)), tensors["b"][3:4])
    assert w.read("a", (4, 4)).shape == (0, 5)


def test_a_damaged_file_is_a_usage_error(tmp_path):
    save_file({"a": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(UsageError, match="damaged or truncated"):
        WeightsDir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(UsageError, match="not a safetensors file"):
        WeightsDir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="holds no \\*.safetensors"):
        WeightsDir(tmp_path)


# ---- adapters and config --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_then_load_gives_the_same_model(name, tmp_path):
    """Our tensors -> the family's names and layout (sharded with an index) -> our tensors, bit for bit."""
    spec = spec_of(name)
    model = random_model(spec)
    write_hf(model, spec, tmp_path / "hf", shard_every=7)
    assert (tmp_path / "hf" / INDEX).is_file()
    check_config(spec, tmp_path / "hf")
    weights = check_weights(spec, tmp_path / "hf")
    fresh = build_model(spec)
    load_part(fresh, spec, weights, CPU)
    got, want = dict(state_tensors(fresh)), dict(state_tensors(model))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    x = torch.randint(0, spec.vocab, (2, 24))
    assert torch.equal(fresh(x), model(x))


def test_hf_names_of_each_family():
    """A few names per family, as transformers 5.23's save_pretrained writes them (save_original_format)."""
    def hf_names(spec: ModelSpec) -> set[str]:
        ours = dict(state_tensors(build_model(spec)))  # meta: shapes only
        return {k for r in export_rules(spec) for k in r.save({n: ours[n] for n in r.ours})}

    names = {name: hf_names(spec_of(name)) for name in ("mixtral", "qwen2-moe", "deepseek-v3", "gpt2", "qwen2-tied")}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names["mixtral"]
    assert "model.layers.0.block_sparse_moe.gate.weight" in names["mixtral"]
    assert {"model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight",
            "model.layers.1.mlp.shared_expert.down_proj.weight"} <= names["qwen2-moe"]
    assert {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.1.self_attn.q_a_layernorm.weight"} <= names["deepseek-v3"]
    assert {"transformer.h.1.attn.c_attn.weight", "transformer.wpe.weight"} <= names["gpt2"]
    assert "lm_head.weight" not in names["qwen2-tied"] and "lm_head.weight" in names["mixtral"]


def test_fused_experts_and_unprefixed_gpt2_load_too(tmp_path):
    """transformers 5's in-memory expert layout on disk (gate_up_proj, down_proj) and GPT-2 without `transformer.`."""
    spec = spec_of("qwen3-moe")
    model = random_model(spec)
    tensors = write_hf(model, spec, tmp_path / "legacy")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(spec.n_layers):
        p = f"model.layers.{layer}.mlp.experts"
        gate, up, down = ([tensors[f"{p}.{e}.{n}.weight"] for e in range(4)] for n in ("gate_proj", "up_proj",
                                                                                     "down_proj"))
        fused[f"{p}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        fused[f"{p}.down_proj"] = torch.stack(down)
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "legacy" / "config.json").read_text())
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    fresh = build_model(spec)
    load_part(fresh, spec, check_weights(spec, tmp_path / "fused"), CPU)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state_tensors(fresh), state_tensors(model), strict=True))

    spec = spec_of("gpt2")
    model = random_model(spec)
    tensors = write_hf(model, spec, tmp_path / "gpt2")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(tmp_path / "gpt2" /
                                                                                  "model.safetensors"))
    fresh = build_model(spec)
    load_part(fresh, spec, check_weights(spec, tmp_path / "gpt2"), CPU)
    x = torch.randint(0, 128, (1, 16))
    assert torch.equal(fresh(x), model(x))


def test_a_mismatch_is_refused_before_loading_naming_fields_and_tensors(tmp_path):
    spec = spec_of("qwen3")
    write_hf(random_model(spec), spec, tmp_path / "hf")
    other = dataclasses.replace(spec, rope_theta=1e6, n_kv_heads=4)
    with pytest.raises(UsageError, match=r"n_kv_heads: plan 4, .* 2; rope_theta: plan 1000000.0"):
        check_config(other, tmp_path / "hf")
    with pytest.raises(UsageError, match=r"k_proj.weight has shape \(64, 64\), the model needs \(128, 64\)"):
        check_weights(other, tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(UsageError, match="model.layers.1.self_attn.q_norm.weight missing"):
        check_weights(spec, tmp_path / "hf")


@pytest.mark.parametrize("name", ["debug", "debug-gpt", "mixtral-8x7b", "llama3-8b", *CONFIGS])
def test_written_config_reads_back_as_the_model(name):
    spec = spec_of(name) if name in CONFIGS else load_model(name)
    written = config_json(spec, "bf16")
    back = model_from_hf_config(written, default_name=spec.name)
    assert back == dataclasses.replace(spec, family=written["model_type"], activation=spec.mlp_activation)
    assert written["dtype"] == "bfloat16"


def test_no_config_for_a_model_no_family_computes():
    with pytest.raises(UsageError, match="no Hugging Face family computes it"):
        config_json(load_model("debug-moe"), "fp32")  # softmax routing with an ungated shared expert


# ---- each rank's shard ---------------------------------------------------------------------


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("placements", ["S0", "S1", "S0,S0", "S0,S1", "R,S0", "S1,R"])
def test_each_rank_reads_the_shard_distribute_tensor_cuts(fake_world, placements, tmp_path):
    """Every rank of a 2x2 (or 4) mesh gets what distribute_tensor(..., src_data_rank=None) gives it, uneven
    shards included, whether read by rows from the file or cut from the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from executor.hf.adapter import Same, Transposed

    full = torch.randn(11, 7)
    save_file({"w": full, "wt": full.t().contiguous()}, str(tmp_path / "model.safetensors"))
    w = WeightsDir(tmp_path)
    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    place = [kinds[p] for p in placements.split(",")]
    for rank in range(4):
        fake_world(rank, 4)
        mesh = init_device_mesh("cpu", (4,) if len(place) == 1 else (2, 2))
        target = distribute_tensor(full, mesh, place, src_data_rank=None)
        assert isinstance(target, DTensor)
        for rule in (Same(("x",), ("w",)), Transposed(("x",), ("wt",))):
            got = local_value(rule, w.read, "x", target, None, CPU)
            assert torch.equal(got, target.to_local()), (rank, rule)


def test_a_shard_reads_only_its_rows(fake_world, tmp_path, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from executor.hf.adapter import Same

    save_file({"w": torch.randn(16, 4)}, str(tmp_path / "model.safetensors"))
    w = WeightsDir(tmp_path)
    asked = []
    monkeypatch.setattr(w, "read", lambda key, rows=None, read=w.read: asked.append(rows) or read(key, rows))
    fake_world(3, 4)
    target = distribute_tensor(torch.zeros(16, 4), init_device_mesh("cpu", (4,)), [Shard(0)], src_data_rank=None)
    local_value(Same(("x",), ("w",)), w.read, "x", target, None, CPU)
    assert asked == [(12, 16)]


# ---- model features ------------------------------------------------------------------------


def test_sliding_window_attention_matches_an_explicit_softmax():
    from executor.attention import attention_core

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 20, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kr.transpose(-1, -2) / math.sqrt(8)
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    scores = scores.masked_fill(~((j <= i) & (j > i - 5)), float("-inf"))
    want = scores.softmax(-1) @ vr
    assert torch.allclose(attention_core(q, k, v, window=5), want, atol=1e-5)
    causal = (q @ kr.transpose(-1, -2) / math.sqrt(8)).masked_fill(j > i, float("-inf"))
    assert torch.allclose(attention_core(q, k, v, window=64), causal.softmax(-1) @ vr, atol=1e-5)


@pytest.mark.parametrize("cp, window", [(2, 5), (2, 16), (4, 3)])
def test_context_parallel_chunks_keep_the_window(cp, window):
    from executor.attention import attention_core

    torch.manual_seed(1)
    seq = 8 * cp
    q, k, v = torch.randn(1, 4, seq, 8), torch.randn(1, 2, seq, 8), torch.randn(1, 2, seq, 8)
    full = attention_core(q, k, v, window=window)
    for rank in range(cp):
        shard = ContextShard(None, rank, cp)
        shard.prepare(seq // cp)
        kg, vg = (torch.cat([shard_sequence(t, ContextShard(None, r, cp), dim=2) for r in range(cp)], dim=2)
                  for t in (k, v))
        out = attend_gathered(shard_sequence(q, shard, dim=2), kg, vg, shard, window=window)
        assert torch.allclose(out, shard_sequence(full, shard, dim=2), atol=1e-5)


def test_rope_scaling_rules():
    base, _ = inv_freq_and_factor(64, 500000.0)
    linear, factor = inv_freq_and_factor(64, 500000.0, RopeScaling(kind="linear", factor=4.0))
    assert torch.allclose(linear, base / 4) and factor == 1.0
    llama3, _ = inv_freq_and_factor(64, 500000.0, RopeScaling(kind="llama3", factor=8.0, original_max_position=8192))
    wavelen = 2 * math.pi / base
    assert torch.equal(llama3[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies kept
    assert torch.allclose(llama3[wavelen > 8192], base[wavelen > 8192] / 8)  # low frequencies divided
    yarn, factor = inv_freq_and_factor(64, 10000.0, RopeScaling(kind="yarn", factor=40.0, original_max_position=4096))
    assert factor == pytest.approx(0.1 * math.log(40) + 1)
    assert yarn[0] == base_yarn(0) and yarn[-1] == pytest.approx(base_yarn(31) / 40)


def base_yarn(i: int) -> float:
    return 10000.0 ** (-2 * i / 64)


def test_group_limited_sigmoid_router_against_a_per_token_loop():
    from executor.model import FeedForward
    from executor.moe import MoE

    spec = dataclasses.replace(load_model("debug-moe"), moe=MoESpec(
        n_experts=8, top_k=2, expert_ffn_hidden=16, router_bias=True, scoring="sigmoid", routed_scaling=2.5,
        n_group=4, topk_group=2))
    moe = MoE(spec, FeedForward)
    torch.manual_seed(3)
    with torch.no_grad():
        moe.router.weight.normal_()
        moe.score_bias.copy_(torch.randn(8) * 0.3)
    tokens = torch.randn(32, 64)
    weights, experts = moe.route(tokens)
    scores = (tokens @ moe.router.weight.t()).sigmoid()
    for t in range(32):
        choice = scores[t] + moe.score_bias
        groups = choice.view(4, 2)
        best_groups = groups.topk(2, dim=-1)[0].sum(-1).topk(2)[1].tolist()
        allowed = [g * 2 + i for g in best_groups for i in range(2)]
        picked = sorted(allowed, key=lambda e: -choice[e])[:2]
        assert sorted(experts[t].tolist()) == sorted(picked)
        chosen = scores[t][experts[t]]
        assert torch.allclose(weights[t], chosen / chosen.sum() * 2.5)
