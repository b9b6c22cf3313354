"""`meshplan plan --precision --recompute --attention --compile --engine torchtitan`, and the new presets."""

from __future__ import annotations

import pytest

from planner.plan import load_plan


def test_training_flags_land_in_plan_json(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli("plan", "--model", "8B", "--gpus", "8", "--engine", "torchtitan", "--precision", "fp8", "--compile",
            "--recompute", "op", "--json", "-o", str(out))
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["schema_version"] == 3
    assert (doc["training"]["precision"], doc["training"]["dtype"], doc["training"]["compile"]) == ("fp8", "bf16", True)
    assert doc["training"]["attention"] == "fused" and doc["parallel"]["recompute"] == "op"
    assert load_plan(out).training.fp8


def test_eager_megatron_on_an_nvl72_rack(cli):
    r = cli("plan", "--model", "70B", "--gpus", "128", "--cluster", "gb200-nvl72", "--engine", "megatron",
            "--attention", "eager", "--precision", "mxfp8", "--seq-len", "4096", "--global-batch", "64", "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["training"]["attention"] == "eager" and doc["cluster"]["gpus_per_node"] == 64


@pytest.mark.parametrize("args, message", [
    (("--precision", "mxfp8"), "mxfp8 needs Blackwell"),
    (("--engine", "megatron", "--recompute", "op"), "implements none, selective, full"),
    (("--engine", "megatron", "--compile"), "does not compile"),
    (("--precision", "fp8", "--cluster", "dgx-a100-80g"), "no 8-bit tensor cores"),
    (("--precision", "fp8", "--tp", "2"), "float8 tensor-parallel"),
    (("--precision", "fp8", "--cluster", "cpu"), "CPU ranks run in fp32"),
])
def test_options_an_engine_or_gpu_cannot_honour_are_usage_errors(cli, args, message):
    r = cli("plan", "--model", "8B", "--gpus", "8", *args)
    assert r.code in (2, 3) and message in r.stderr, r.stderr


@pytest.mark.parametrize("preset", ["gb200-nvl72", "gb300-nvl72", "dgx-b300", "hgx-h800"])
def test_new_presets_plan(cli, preset):
    r = cli("plan", "--model", "8B", "--gpus", "8", "--cluster", preset, "--engine", "megatron", "--json")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize("cluster, gpu", [("t4-pcie", "t4"), ("dgx-a100-80g", "v100")])
def test_gpus_without_bf16_name_precision_fp16(cluster, gpu):
    """T4 and V100 have no bf16 tensor cores: plan and compare both say to pass --precision fp16, and it plans."""
    from conftest import invoke_cli

    sets = () if gpu == "t4" else ("--set", "gpu=v100")
    for verb in ("plan", "compare"):
        r = invoke_cli(verb, "--model", "llama3.2-1b", "--cluster", cluster, "--gpus", "4", *sets)
        assert r.code == 2 and "--precision fp16" in r.stderr and gpu in r.stderr, r.stderr
        ok = invoke_cli(verb, "--model", "llama3.2-1b", "--cluster", cluster, "--gpus", "4", *sets,
                        "--precision", "fp16", "--seq-len", "1024", "--json")
        assert ok.code == 0, ok.stderr
