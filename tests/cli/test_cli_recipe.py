"""`meshplan plan --recipe KEY=true|false`: the training stack's recipe options reach the search, plan.json
and the export; what the training or the engine refuses is a usage error (exit 2) naming the value."""

from __future__ import annotations

import pytest

from planner.plan import load_plan


def test_recipe_options_land_in_plan_json_and_the_megatron_export(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli("plan", "--model", "8B", "--gpus", "8", "--engine", "megatron", "--precision", "fp8",
            "--recipe", "fp8_params=true", "--recipe", "fused_cross_entropy=true", "--json", "-o", str(out))
    assert r.code == 0, r.stderr
    training = load_plan(out).training
    assert training.fp8_params and training.fused_cross_entropy and not training.cuda_graphs
    exported = cli("export", str(out), "--to", "megatron")
    assert exported.code == 0, exported.stderr
    assert "--fp8-param-gather" in exported.stdout and "--cross-entropy-fusion-impl te" in exported.stdout


def test_eight_bit_parameters_need_less_memory_than_sixteen_bit_weights_with_copies(cli):
    def peak(*recipe: str) -> float:
        r = cli("plan", "--model", "8B", "--gpus", "8", "--engine", "megatron", "--precision", "fp8", "--tp", "1",
                "--pp", "1", "--zero", "1", "--micro-batch", "1", "--recompute", "full", *recipe, "--json")
        assert r.code == 0, r.stderr
        return r.json()["prediction"]["peak_memory_bytes"]

    assert peak("--recipe", "fp8_params=true") < peak()


def test_16_bit_moments_export_as_megatrons_precision_aware_optimizer(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli("plan", "--model", "8B", "--gpus", "8", "--engine", "megatron", "--recipe", "optimizer_dtype=bf16",
            "--json", "-o", str(out))
    assert r.code == 0, r.stderr
    assert load_plan(out).training.optimizer_dtype == "bf16"
    exported = cli("export", str(out), "--to", "megatron")
    assert "--use-precision-aware-optimizer" in exported.stdout and "--exp-avg-sq-dtype bf16" in exported.stdout


@pytest.mark.parametrize("args, message", [
    (("--recipe", "cuda_graph=true"), "expected KEY=VALUE with KEY one of cuda_graphs"),
    (("--recipe", "cuda_graphs=maybe"), "cuda_graphs takes true or false, got 'maybe'"),
    (("--recipe", "cuda_graphs=true", "--recipe", "cuda_graphs=false"), "given twice"),
    (("--engine", "megatron", "--recipe", "fp8_params=true"), "needs precision fp8 or mxfp8, got bf16"),
    (("--precision", "fp8", "--recipe", "fp8_params=true"), "engine meshplan@0.1 keeps 16-bit weights"),
    (("--recipe", "optimizer_dtype=bf16"), "engine meshplan@0.1 keeps the optimizer's moments in fp32"),
    (("--engine", "megatron", "--recipe", "optimizer_dtype=fp8"), "optimizer_dtype takes fp32, bf16, fp16"),
])
def test_recipe_options_that_cannot_run_are_usage_errors(cli, args, message):
    r = cli("plan", "--model", "8B", "--gpus", "8", *args)
    assert r.code == 2 and message in r.stderr, r.stderr
