"""The planner's side of Hugging Face models: config.json keys execution needs, plan.json schema 3, what the
executor refuses by name, where the weights are, and the exports that carry them (no torch here).

Configs are the released config.json values of each model (Hugging Face hub: meta-llama/Llama-3.1-8B,
Qwen/Qwen2.5-7B, Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.1, deepseek-ai/DeepSeek-V3), trimmed to the keys
meshplan reads; the v5 spellings are what transformers 5.23's save_pretrained writes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import invoke_cli
from test_export import make_plan

from planner.engines.refusals import unbuilt_features
from planner.export import export_plan
from planner.export.launch import torchrun_commands
from planner.model.hf_config import model_from_hf_config
from planner.model.spec import ModelSpec, RopeScaling
from planner.plan import Plan, load_plan
from planner.run_flags import RANDOM_INIT, RunFlags
from topologies.errors import ModelError

LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
             "max_window_layers": 28, "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "head_dim": 128,
            "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
            "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
            "tie_word_embeddings": False, "hidden_act": "silu"}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "sliding_window": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
               "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
               "topk_method": "noaux_tc", "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "num_nextn_predict_layers": 0, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
               "rope_theta": 10000, "hidden_act": "silu",
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"}}


def read(config: dict, name: str = "m") -> ModelSpec:
    return model_from_hf_config(config, default_name=name)


def test_llama31_rope_and_eps_in_both_config_spellings():
    """transformers 4.x (rope_theta + rope_scaling) and 5.x (rope_parameters) read as the same model."""
    v4 = read(LLAMA31_8B)
    assert (v4.family, v4.rope_theta, v4.norm_eps, v4.activation) == ("llama", 500000.0, 1e-5, "silu")
    assert v4.rope_scaling == RopeScaling(kind="llama3", factor=8.0, original_max_position=8192,
                                          low_freq_factor=1.0, high_freq_factor=4.0)
    v5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert read(v5) == v4
    assert v4.total_params == read({**LLAMA31_8B, "rope_scaling": None}).total_params  # counts do not move


def test_family_defaults_and_routing_keys():
    qwen = read(QWEN25_7B)
    assert qwen.qkv_bias and qwen.rope_theta == 1e6 and qwen.norm_eps == 1e-6 and not qwen.sliding_window
    assert read(QWEN3_8B).qk_norm and read(QWEN3_8B).head_dim == 128
    ds = read(DEEPSEEK_V3)
    m = ds.moe
    assert (m.scoring, m.router_bias, m.norm_topk_prob, m.routed_scaling, m.n_group, m.topk_group) == \
        ("sigmoid", True, True, 2.5, 8, 4)
    assert ds.rope_scaling == RopeScaling(kind="yarn", factor=40.0, original_max_position=4096, mscale=1.0,
                                          mscale_all_dim=1.0)
    assert ds.mla.rope_interleave
    qwen_moe = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                "vocab_size": 128}
    assert not read(qwen_moe).moe.norm_topk_prob  # Qwen3MoeConfig's default
    assert read({**qwen_moe, "norm_topk_prob": True}).moe.norm_topk_prob
    mixtral = {**qwen_moe, "model_type": "mixtral", "norm_topk_prob": False}
    assert read(mixtral).moe.norm_topk_prob and read(mixtral).norm_eps == 1e-5  # Mixtral always renormalizes
    gpt2 = read({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128,
                 "layer_norm_epsilon": 1e-4, "activation_function": "gelu"})
    assert (gpt2.family, gpt2.norm_eps, gpt2.activation) == ("gpt2", 1e-4, "gelu")


def test_sliding_layers_follow_each_family():
    mistral = read(MISTRAL_7B)
    assert mistral.sliding_layers == 32 and all(mistral.window_of(i) == 4096 for i in range(32))
    small = {**QWEN25_7B, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 512,
             "max_window_layers": 2}
    assert read(small).sliding_layer_ids == (2, 3)  # Qwen2: the layers from max_window_layers on
    typed = {**small, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}
    assert read(typed).sliding_layer_ids == (0, 2)  # transformers 5 lists them
    assert [read(typed).window_of(i) for i in range(4)] == [512, 0, 512, 0]
    with pytest.raises(ModelError, match="sliding_layer_ids"):
        ModelSpec.from_json({**read(typed).to_json(), "sliding_layers": 3})


def test_bad_execution_keys_name_the_key():
    with pytest.raises(ModelError, match="hidden_act 'relu2'"):
        read({**LLAMA31_8B, "hidden_act": "relu2"})
    with pytest.raises(ModelError, match="rms_norm_eps"):
        read({**LLAMA31_8B, "rms_norm_eps": "small"})
    with pytest.raises(ModelError, match="factor"):
        read({**LLAMA31_8B, "rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": [8]}})


@pytest.mark.parametrize("config", [LLAMA31_8B, QWEN25_7B, QWEN3_8B, MISTRAL_7B, DEEPSEEK_V3],
                         ids=["llama3.1", "qwen2.5", "qwen3", "mistral", "deepseek-v3"])
def test_the_executor_builds_these_families(config):
    assert unbuilt_features(read(config)) == []


def test_unbuilt_features_are_refused_by_name():
    gemma = read({"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 96, "vocab_size": 128, "head_dim": 16})
    assert any(f.startswith("family gemma2 (embeddings scaled") for f in unbuilt_features(gemma))
    phi_long = read({**LLAMA31_8B, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    assert unbuilt_features(phi_long) == ["rope_scaling longrope"]
    partial = read({**LLAMA31_8B, "rope_scaling": None, "partial_rotary_factor": 0.5})
    assert unbuilt_features(partial) == ["rope_scaling default+partial_rotary"]
    assert unbuilt_features(read({**DEEPSEEK_V3, "num_nextn_predict_layers": 1})) == ["mtp_layers"]


def _v3_plan(model: ModelSpec, **layout) -> Plan:
    plan = make_plan(8, **layout)
    return dataclasses.replace(plan, model=model, layout=dataclasses.replace(
        plan.layout, layers_per_stage=(model.n_layers,) if plan.layout.pp == 1 else plan.layout.layers_per_stage))


def test_plan_schema_3_round_trips_and_version_2_loads_with_the_old_defaults(tmp_path):
    plan = dataclasses.replace(_v3_plan(read(LLAMA31_8B), tp=8, micro_batch_size=1, grad_accum_steps=256),
                               weights_dir="/models/llama")
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["schema_version"] == 3 and data["weights_dir"] == "/models/llama"
    assert data["model"]["rope_scaling"]["kind"] == "llama3"
    assert load_plan(tmp_path / "p.json") == plan
    old = dict(data, schema_version=2)
    old.pop("weights_dir")
    old["model"] = {k: v for k, v in data["model"].items()
                    if k not in ("family", "rope_theta", "rope_scaling", "norm_eps", "activation", "sliding_layer_ids")}
    (tmp_path / "v2.json").write_text(json.dumps(old))
    v2 = load_plan(tmp_path / "v2.json")
    assert (v2.model.rope_theta, v2.model.rope_scaling, v2.model.norm_eps, v2.weights_dir) == (10000.0, None, 1e-5,
                                                                                               None)


def test_plan_records_the_weights_and_the_launch_carries_them(tmp_path):
    model = tmp_path / "Tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**MISTRAL_7B, "num_hidden_layers": 2, "hidden_size": 256,
                                                   "intermediate_size": 512, "vocab_size": 512}))
    args = ("plan", "--model", str(model), "--cluster", "cpu", "--gpus", "2", "--global-batch", "4",
            "--seq-len", "64")
    r = invoke_cli(*args, "-o", str(tmp_path / "no-weights.json"))
    assert r.code == 0, r.stderr
    assert load_plan(tmp_path / "no-weights.json").weights_dir is None  # a config alone: nothing to load
    (model / "model.safetensors").write_bytes(b"")
    r = invoke_cli(*args, "-o", str(tmp_path / "p.json"))
    assert r.code == 0, r.stderr
    plan = load_plan(tmp_path / "p.json")
    assert plan.weights_dir == str(model.resolve())
    assert torchrun_commands(plan, "p.json")[0][3:] == ["--init-from", str(model.resolve())]
    run = RunFlags(steps=5, out="runs/x")
    line = torchrun_commands(plan, "p.json", run=run)[0]
    assert line[line.index("--init-from") + 1] == str(model.resolve())
    line = torchrun_commands(plan, "p.json", run=run.replace(init_from=RANDOM_INIT))[0]
    assert line[line.index("--init-from") + 1] == "none"  # an explicit random start survives the export
    r = invoke_cli("execute", str(tmp_path / "p.json"), "--print-launch", "torchrun", "--steps", "3")
    assert r.code == 0 and f"--init-from {model.resolve()}" in r.stdout, r.stdout + r.stderr


def test_run_flags_carry_init_from_and_save_hf_every():
    flags = RunFlags(steps=7, out="o", init_from="/m", save_hf_every=3)
    assert RunFlags.from_argv(flags.to_argv()) == flags
    assert flags.weights_source == "/m" and RunFlags(init_from=RANDOM_INIT).weights_source is None


def _megatron(model: ModelSpec, tmp_path, **layout) -> tuple[str, list[str]]:
    result = export_plan(_v3_plan(model, tp=4, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=128,
                                          **layout), "megatron")
    return result.text, list(result.notes)


def test_megatron_states_the_features_it_knows(tmp_path):
    text, notes = _megatron(read(QWEN25_7B), tmp_path)
    assert "--add-qkv-bias" in text and "--rotary-base 1000000" in text and "--norm-epsilon 1e-06" in text
    assert notes == [] and "could not express: nothing" in text
    text, _ = _megatron(read(QWEN3_8B), tmp_path)
    assert "--qk-layernorm" in text and "--add-qkv-bias" not in text
    text, _ = _megatron(read(MISTRAL_7B), tmp_path)
    assert "--window-size 4095,0" in text and "--window-attn-skip-freq" not in text
    text, notes = _megatron(read(LLAMA31_8B), tmp_path)
    assert "--use-rope-scaling" in text and "--rope-scaling-factor 8.0" in text
    assert not [n for n in notes if "rope" in n]


def test_megatron_says_what_it_cannot_express(tmp_path):
    llama = read({**LLAMA31_8B, "rope_scaling": {**LLAMA31_8B["rope_scaling"], "original_max_position_embeddings":
                                                 4096}})
    _, notes = _megatron(llama, tmp_path)
    assert any("Megatron fixes them at 1/4 over 8192" in n for n in notes)
    _, notes = _megatron(read({**LLAMA31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), tmp_path)
    assert any("rope scaling yarn" in n and "outside MLA" in n for n in notes)
    alternating = read({**QWEN25_7B, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 512,
                        "max_window_layers": 2})
    text, _ = _megatron(alternating, tmp_path)
    assert "--window-attn-skip-freq '[0,0,1,1]'" in text
    ds = read({**DEEPSEEK_V3, "num_hidden_layers": 8})
    text, notes = _megatron(ds, tmp_path)
    for flag in ("--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-topk-scaling-factor 2.5", "--moe-router-num-groups 8", "--moe-router-group-topk 4",
                 "--rope-type yarn", "--rotary-scaling-factor 40.0", "--mscale-all-dim 1.0"):
        assert flag in text, flag
