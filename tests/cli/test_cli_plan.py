"""`meshplan plan` run as a subprocess: pinned flags, plan.json contract, exit codes, help."""

from __future__ import annotations

import json

import pytest

from planner.plan import load_plan

PARALLEL_KEYS = {"tp", "pp", "dp_replicate", "dp_shard", "cp", "ep", "zero_stage", "micro_batch_size",
                 "grad_accum_steps", "recompute", "sequence_parallel", "pp_schedule", "virtual_stages"}
PREDICTION_KEYS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes",
                   "memory_breakdown_bytes", "time_breakdown_s"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "comm_buffers", "other"}
CPU = ("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64")


def test_executor_command_writes_a_loadable_plan(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli(*CPU, "--tp", "2", "--dp", "2", "-o", str(out))
    assert r.code == 0, r.stderr
    plan = load_plan(out)  # the executor's loader accepts it
    assert plan.layout.tp == 2 and plan.layout.dp == 2 and plan.world_size == 4
    assert plan.training.global_batch_size == 8 and plan.training.seq_len == 64
    lay = plan.layout
    assert lay.micro_batch_size * lay.grad_accum_steps * lay.dp == 8
    assert sum(lay.layers_per_stage) == 4


@pytest.mark.parametrize("flags, expected", [
    (("--zero", "1", "--dp-shard", "2"), dict(zero_stage=1, dp_shard=2)),
    (("--zero", "0", "--dp", "4"), dict(zero_stage=0, dp_shard=1, dp_replicate=4)),
    (("--zero", "3", "--dp", "4", "--dp-shard", "2"), dict(zero_stage=3, dp_shard=2, dp_replicate=2)),
    (("--pp", "2", "--tp", "1"), dict(pp=2, tp=1)),
    (("--pp", "2", "--pp-schedule", "gpipe"), dict(pp=2, pp_schedule="gpipe")),
    (("--pp", "2", "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"),
     dict(pp_schedule="interleaved-1f1b", virtual_stages=2)),
    (("--pp", "2", "--pp-schedule", "zb-v"), dict(pp_schedule="zb-v", virtual_stages=2)),
    (("--cp", "2", "--engine", "megatron"), dict(cp=2)),
    (("--micro-batch", "2",), dict(micro_batch_size=2)),
    (("--recompute", "full",), dict(recompute="full")),
    (("--tp", "2", "--no-sequence-parallel"), dict(tp=2, sequence_parallel=False)),
    (("--tp", "2", "--sequence-parallel"), dict(tp=2, sequence_parallel=True)),
])
def test_pinned_flags_are_honoured(cli, flags, expected):
    r = cli(*CPU, *flags, "--json")
    assert r.code == 0, r.stderr
    parallel = r.json()["parallel"]
    for key, value in expected.items():
        assert parallel[key] == value, (key, parallel)
    assert parallel["micro_batch_size"] * parallel["grad_accum_steps"] * parallel["dp_replicate"] \
        * parallel["dp_shard"] == 8


def test_json_holds_the_contract_keys(cli, tmp_path):
    out = tmp_path / "plan.json"
    r = cli("plan", "--model", "13B", "--gpus", "16", "--json", "-o", str(out))
    assert r.code == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is JSON only
    assert doc == json.loads(out.read_text())
    assert PARALLEL_KEYS <= set(doc["parallel"])
    assert PREDICTION_KEYS <= set(doc["prediction"])
    assert set(doc["prediction"]["memory_breakdown_bytes"]) == MEMORY_KEYS
    assert {"compute", "exposed_comm", "bubble"} <= set(doc["prediction"]["time_breakdown_s"])
    assert doc["alternatives"], "the next best layouts"
    for alt in doc["alternatives"]:
        assert PARALLEL_KEYS <= set(alt["parallel"]) and PREDICTION_KEYS <= set(alt["prediction"])
        assert alt["why_lost"] and alt["prediction"]["step_time_s"] >= doc["prediction"]["step_time_s"]
    assert all(isinstance(s, str) and s for s in doc["explanation"])


def test_human_output_has_the_table_and_the_reasons(cli):
    r = cli("plan", "--model", "13B", "--gpus", "16")
    assert r.code == 0, r.stderr
    for word in ("llama2-13b", "tp", "ZeRO", "MFU", "tok/s", "GiB", "Best of", "Runner-up"):
        assert word in r.stdout, word


def test_no_feasible_layout_exits_3_with_the_shortfall(cli):
    r = cli("plan", "--model", "405B", "--gpus", "8")
    assert r.code == 3
    assert "needs" in r.stderr and "has 76.0" in r.stderr and "add GPUs" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_pinned_zero_in_the_fix(cli):
    r = cli("plan", "--model", "70B", "--gpus", "8", "--zero", "1")
    assert r.code == 3 and "ZeRO-3" in r.stderr


@pytest.mark.parametrize("flags", [
    ("--model", "13B", "--gpus", "16", "--tp", "3"),
    ("--model", "13B", "--gpus", "16", "--zero", "0", "--dp-shard", "2"),
    ("--model", "13B", "--gpus", "16", "--tp", "4", "--dp", "8"),
    ("--model", "13B", "--gpus", "16", "--zero", "7"),
    ("--model", "llama9", "--gpus", "16"),
    ("--model", "debug", "--cluster", "cpu", "--gpus", "4", "--global-batch", "6", "--dp", "4"),
])
def test_bad_flags_exit_2(cli, flags):
    r = cli("plan", *flags)
    assert r.code == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


def test_help_documents_the_defaults(cli):
    r = cli("plan", "--help")
    assert r.code == 0
    text = " ".join(r.stdout.split())
    assert "dgx-h100" in text and "at most 4096" in text and "1M tokens" in text


def test_png_is_written(cli, tmp_path):
    png = tmp_path / "mem.png"
    r = cli(*CPU, "--tp", "2", "--png", str(png))
    assert r.code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_does_not_import_torch(cli):
    r = cli("plan", "--model", "13B", "--gpus", "16", "--json", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.code == 0
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "planner.search.search" in imported and "torch" not in imported


def test_default_batch_rounding_is_reported(cli):
    # 2^20 tokens / 2048 = 512 sequences, not a multiple of dp 3: the plan runs 513 and says so
    r = cli("plan", "--model", "7B", "--gpus", "24", "--seq-len", "2048", "--dp", "3", "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["training"]["global_batch_size"] == 513
    assert any("rounded from 512 to 513" in s for s in doc["explanation"])


def test_meshplan_engine_never_plans_what_its_executor_refuses(cli):
    """MoE layers under TP + sequence parallel are not in the executor: pinning it for engine meshplan is a
    usage error naming why."""
    moe = ("plan", "--model", "debug-moe", *CPU[3:])
    r = cli(*moe, "--tp", "2", "--sequence-parallel")
    assert r.code == 2
    assert "with tp (2) and sequence parallel" in r.stderr and "--engine megatron" in r.stderr
    r = cli(*CPU, "--json")
    assert r.code == 0, r.stderr
    from planner.engines import executor_refusal
    from planner.layout import Layout
    from planner.model.load import load_model

    data = r.json()
    for entry in [data["parallel"], *(alt["parallel"] for alt in data["alternatives"])]:
        layout = Layout.from_json(entry)
        assert executor_refusal(load_model("debug"), layout, data["training"]["dtype"], on_gpu=False) is None
