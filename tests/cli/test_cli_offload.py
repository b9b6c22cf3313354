"""`--offload none|optimizer|params|auto` on plan, compare and simulate: what fits a 7-8B full fine-tune on
4x RTX 4090 (24 GB), its host figures, and bad input."""

from __future__ import annotations

import json

import pytest
from conftest import invoke_cli

QWEN = "tests/data/hf_configs/qwen2.5-7b.json"
BOX = ("--cluster", "rtx4090-pcie", "--gpus", "4", "--global-batch", "64")


def _plan(model: str, *flags: str) -> dict:
    res = invoke_cli("plan", "--model", model, *BOX, *flags, "--json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("model", [QWEN, "8B"])
def test_seven_to_eight_billion_full_fine_tuning_fits_four_4090s_with_offload(model):
    res = invoke_cli("plan", "--model", model, *BOX)
    assert res.code == 3 and "--offload auto" in res.stderr  # without offload: 30+ GiB of state per GPU
    res = invoke_cli("plan", "--model", model, *BOX, "--offload", "auto")
    assert res.code == 0, res.stderr
    text = " ".join(res.stdout.split())  # rich wraps lines at the terminal's width
    assert "Host (optimizer+params offloaded)" in text
    assert "GiB of 410 usable per node" in text and "PCIe Gen4 x16" in text
    plan = _plan(model, "--offload", "auto")
    assert plan["parallel"]["offload"] == "optimizer+params" and plan["parallel"]["zero_stage"] == 3
    host = plan["prediction"]["offload"]
    assert 0 < host["host_memory_per_node_bytes"] <= host["host_memory_capacity_bytes"]
    assert host["down_bytes"] > 0 and host["up_bytes"] > 0 and host["host_optimizer_s"] > 0
    assert plan["prediction"]["step_time_s"] > 0
    assert plan["prediction"]["peak_memory_bytes"] <= 0.95 * 24e9


def test_deepspeed_plans_optimizer_offload_and_meshplan_refuses_it():
    plan = _plan(QWEN, "--engine", "deepspeed", "--offload", "optimizer")
    assert plan["parallel"]["offload"] == "optimizer"
    assert plan["prediction"]["offload"]["parameter_upload_s"] > 0
    res = invoke_cli("plan", "--model", QWEN, *BOX, "--offload", "optimizer")
    text = " ".join(res.stderr.split())
    assert res.code == 2 and "does not offload 'optimizer'" in text and "--engine deepspeed" in text


def test_host_memory_too_small_is_infeasible_with_the_figures():
    res = invoke_cli("plan", "--model", QWEN, *BOX, "--offload", "params", "--set", "host_memory_gib=100")
    assert res.code == 3
    text = " ".join(res.stderr.split())
    assert "host memory per node" in text and "80% of 100 GiB" in text and "Traceback" not in text


def test_bad_offload_values_and_unstated_hosts(tmp_path):
    res = invoke_cli("plan", "--model", QWEN, *BOX, "--offload", "cpu")
    assert res.code == 2 and "'cpu' is not one of 'none', 'optimizer', 'params', 'auto'" in " ".join(res.stderr.split())
    res = invoke_cli("plan", "--model", QWEN, *BOX, "--set", "host_cores=-4", "--offload", "params")
    assert res.code == 2 and "host_cores" in res.stderr
    bare = tmp_path / "box.toml"
    bare.write_text('gpu = "rtx4090"\ngpus_per_node = 4\nintra_node = "pcie"\n')
    res = invoke_cli("plan", "--model", QWEN, "--cluster", str(bare), "--gpus", "4", "--offload", "params")
    text = " ".join(res.stderr.split())
    assert res.code == 2 and "does not state its host" in text and "--set host_memory_gib" in text


def test_simulate_what_if_offload(tmp_path):
    path = tmp_path / "plan.json"
    res = invoke_cli("plan", "--model", "8B", *BOX, "--offload", "params", "-o", str(path))
    assert res.code == 0, res.stderr
    sim = invoke_cli("simulate", str(path), "--json")
    assert sim.code == 0 and json.loads(sim.stdout)["offload"]["kind"] == "optimizer+params"
    none = invoke_cli("simulate", str(path), "--offload", "none", "--json")
    assert none.code == 0 and "offload" not in json.loads(none.stdout)
    refused = invoke_cli("simulate", str(path), "--offload", "optimizer")
    assert refused.code == 2 and "does not offload 'optimizer'" in " ".join(refused.stderr.split())
    human = invoke_cli("simulate", str(path))
    text = " ".join(human.stdout.split())
    assert "host link copies" in text and "Host (optimizer+params offloaded)" in text


def test_compare_with_offload():
    res = invoke_cli("compare", "--model", QWEN, "--cluster", "rtx4090-pcie,rtx3090-pcie", "--gpus", "4",
                     "--global-batch", "64", "--offload", "auto", "--json")
    assert res.code == 0, res.stderr
    rows = json.loads(res.stdout)["variants"]
    assert len(rows) == 2 and all(r["feasible"] and r["parallel"]["offload"] == "optimizer+params" for r in rows)
    assert all(r["prediction"]["offload"]["host_memory_per_node_bytes"] > 0 for r in rows)


def test_sweep_names_the_offload_it_needs():
    from planner.layout import Layout
    from planner.search.explain import short

    res = invoke_cli("plan", "--model", "8B", "--cluster", "rtx4090-pcie", "--gpus", "2-4", "--offload", "auto",
                     "--json")
    assert res.code == 0, res.stderr
    points = json.loads(res.stdout)["points"]
    assert [p["gpus"] for p in points] == [2, 4]
    assert all(p["fits"] and p["parallel"]["offload"] == "optimizer+params" for p in points)
    # the table's compact names (planner.search.explain.short) carry it
    assert "Z3+off-params" in short(Layout(dp_shard=4, zero_stage=3, offload="optimizer+params"))
    assert "+off" not in short(Layout(dp_shard=4, zero_stage=3))
