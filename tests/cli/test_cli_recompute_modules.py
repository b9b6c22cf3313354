"""`meshplan plan --recompute-modules`: Megatron-Core's selective recomputation modules, as plan.json keeps them
and as usage errors (exit 2) name what is wrong."""

from __future__ import annotations

import pytest

from planner.plan import load_plan


def test_modules_land_in_plan_json_and_imply_selective(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli("plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--engine", "megatron",
            "--recompute-modules", "layernorm,moe_act", "--json", "-o", str(out))
    assert r.code == 0, r.stderr
    parallel = r.json()["parallel"]
    assert parallel["recompute"] == "selective" and parallel["recompute_modules"] == ["layernorm", "moe_act"]
    assert load_plan(out).layout.recompute_modules == ("layernorm", "moe_act")
    exported = cli("export", str(out), "--to", "megatron")
    assert exported.code == 0, exported.stderr
    assert "--recompute-modules layernorm moe_act" in exported.stdout


@pytest.mark.parametrize("args, message", [
    (("--engine", "megatron", "--recompute-modules", "core_attn,attention"), "unknown attention"),
    (("--recompute-modules", "core_attn"), "engine meshplan@0.1 has no per-module selective recomputation"),
    (("--engine", "megatron", "--recompute", "full", "--recompute-modules", "mlp"), "but --recompute is full"),
    (("--engine", "megatron", "--recompute-modules", "mla_up_proj"), "has no MLA attention"),
    (("--engine", "megatron", "--recompute-modules", "mlp,mlp"), "a module named twice"),
])
def test_modules_that_cannot_run_are_usage_errors(cli, args, message):
    r = cli("plan", "--model", "8B", "--gpus", "8", *args)
    assert r.code == 2 and message in r.stderr, r.stderr


def test_config_file_takes_the_modules_as_a_list_and_the_table_names_them(cli, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "qwen3-30b-a3b"\ngpus = 8\nengine = "megatron"\n'
                      'recompute_modules = ["layernorm", "moe_act"]\n')
    r = cli("plan", "--config", str(config), "--top", "1")
    assert r.code == 0, r.stderr
    assert "selective:layernorm+moe_act" in r.stdout
