"""`meshplan plan --async-tp`: where it is refused, what plan.json holds, what the exports write."""

from __future__ import annotations

import dataclasses

import pytest

from planner.export import export_plan
from planner.plan import load_plan


@pytest.mark.parametrize("args, message", [
    (("--engine", "deepspeed"), "engines that have one: megatron (--tp-comm-overlap), torchtitan"),
    ((), "engine meshplan has no option"),
    (("--engine", "torchtitan"), "add --compile"),
    (("--engine", "megatron", "--cluster", "cpu"), "CPU ranks"),
    (("--engine", "megatron", "--tp", "1"), "needs tp > 1 with sequence parallel"),
    (("--engine", "megatron", "--no-sequence-parallel"), "--no-sequence-parallel"),
])
def test_async_tp_where_it_cannot_run_is_a_usage_error(cli, args, message):
    r = cli("plan", "--model", "8B", "--gpus", "8", "--async-tp", *args)
    assert r.code == 2 and message in r.stderr, r.stderr


def _plan(cli, tmp_path, *args):
    out = tmp_path / "p.json"
    r = cli("plan", "--model", "8B", "--gpus", "8", "--async-tp", "--seq-len", "8192", "--global-batch", "16",
            *args, "--json", "-o", str(out))
    assert r.code == 0, r.stderr
    return r.json(), load_plan(out)


def test_megatron_async_tp_plan_holds_tp_with_sp_and_exports_tp_comm_overlap(cli, tmp_path):
    doc, plan = _plan(cli, tmp_path, "--engine", "megatron")
    assert doc["training"]["async_tp"] is True and plan.training.async_tp
    assert plan.layout.tp > 1 and plan.layout.sequence_parallel  # the search keeps only layouts it applies to
    text = export_plan(plan, "megatron").text
    assert "--sequence-parallel" in text and "--tp-comm-overlap" in text
    # `simulate` re-prices the plan with its async TP: the same step as the search predicted
    r = cli("simulate", str(tmp_path / "p.json"), "--json")
    assert r.code == 0 and r.json()["step_time_s"] == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    sync = dataclasses.replace(plan, training=plan.training.replace(async_tp=False))
    assert "--tp-comm-overlap" not in export_plan(sync, "megatron").text


def test_torchtitan_async_tp_exports_its_switch_per_release(cli, tmp_path):
    doc, plan = _plan(cli, tmp_path, "--engine", "torchtitan", "--compile")
    assert doc["training"]["async_tp"] is True and doc["training"]["compile"] is True
    toml = export_plan(plan, "torchtitan", version="0.2").text  # [parallelism] in 0.2.2's JobConfig
    parallelism = toml.split("[parallelism]")[1].split("\n[")[0]
    assert "enable_async_tensor_parallel = true" in parallelism
    assert "[compile]" in toml and "enable = true" in toml.split("[compile]")[1]
    module = export_plan(plan, "torchtitan", version="0.3").text  # CompileConfig in 0.3.0
    assert "cfg.compile.enable_async_tensor_parallel = True" in module
    assert "cfg.compile.enable = True" in module
    assert "parallelism.enable_async_tensor_parallel" not in module
