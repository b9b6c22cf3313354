"""--seq-len beyond a model's native context: refused unless --allow-long-context, saying how positions extend."""

from __future__ import annotations

import json

import pytest

from planner.model.context import check_context, long_context_sentence
from planner.model.hf_config import model_from_hf_config
from planner.model.presets import PRESETS
from topologies.errors import UsageError

LLAMA31_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def test_llama3_8b_at_32k_is_refused_and_names_the_way_out():
    model = PRESETS["llama3-8b"]
    with pytest.raises(UsageError) as err:
        check_context(model, 32768, False)
    text = str(err.value)
    assert "native context of 8192" in text and "no rope_scaling" in text and "--allow-long-context" in text
    assert "--seq-len 8192 or less" in text and "YaRN" in text
    check_context(model, 32768, True)  # the user extends the positions: planned
    check_context(model, 8192, False)  # up to the native context: nothing to say
    assert long_context_sentence(model, 8192) is None and "32768" in long_context_sentence(model, 32768)


def test_rope_scaling_read_from_config_and_named():
    model = model_from_hf_config(json.loads(json.dumps(LLAMA31_8B)), default_name="llama-3.1-8b")
    scaling = model.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position) == ("llama3", 8.0, 8192)
    check_context(model, 131072, False)
    with pytest.raises(UsageError, match=r"rope scaling \(llama3, factor 8 over 8192 original positions\).*"
                                         r"Raise rope_scaling's factor"):
        check_context(model, 262144, False)
    older = {**LLAMA31_8B, "rope_scaling": {"type": "linear", "factor": 2.0}}  # transformers' older key
    assert model_from_hf_config(older, default_name="x").rope_scaling.kind == "linear"
    assert model_from_hf_config({**LLAMA31_8B, "rope_scaling": None}, default_name="x").rope_scaling is None
    with pytest.raises(Exception, match="rope_scaling"):
        model_from_hf_config({**LLAMA31_8B, "rope_scaling": "yarn"}, default_name="x")


def test_learned_positions_and_presets():
    with pytest.raises(UsageError, match="learned position table has no row past it"):
        check_context(PRESETS["gpt3-175b"], 4096, False)
    assert PRESETS["llama3.2-1b"].rope_scaling.kind == "llama3" and PRESETS["deepseek-v3"].rope_scaling.kind == "yarn"


def test_cli_refuses_then_plans_with_the_flag():
    from conftest import invoke_cli

    r = invoke_cli("plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "32768")
    assert r.code == 2 and "native context of 8192" in r.stderr
    ok = invoke_cli("plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "32768", "--allow-long-context",
                    "--json")
    assert ok.code == 0, ok.stderr
    assert any("native context of 8192" in s for s in json.loads(ok.stdout)["explanation"])
    r = invoke_cli("compare", "--model", "llama3-8b", "--gpus", "8", "--what-if", "seq_len=4096,16384")
    assert r.code == 2 and "--what-if seq_len 16384" in r.stderr
