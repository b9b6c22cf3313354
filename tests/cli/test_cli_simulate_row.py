"""`meshplan simulate ROW.json`: a published run's row file predicted exactly as the accuracy benches predict it,
and as `meshplan plan` with the row's flags plans it."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO, invoke_cli, load_bench

rowset = load_bench("rowset")

# one row per kind of statement: a NeMo run with a userbuffers config, a MoE run with recipe options, recomputed
# modules and the recipe's own pipeline split, a cluster file (torchtitan's 500 W H100s), a Megatron-DeepSpeed
# run from vTrain, and a paper's row whose micro-batch `plan`'s search picks
ROWS = ("dgxc/dgxc-v25.04-llama31-405b-1024g-fp8.json", "holdout/mb-25.11-gb300-deepseek-v3-256g-bf16.json",
        "torchtitan-h100/t5-405b-3d-interleaved.json", "vtrain/vtrain-single-0000.json",
        "papers/narayanan-2021-145.6b.json")


@pytest.mark.parametrize("name", ROWS)
def test_simulate_prints_the_benchs_prediction(name):
    path = REPO / "bench" / "rows" / name
    res = invoke_cli("simulate", str(path), "--json")
    assert res.code == 0, res.stderr
    doc = json.loads(res.stdout)
    row = next(r for r in rowset.rows(path.parent.name) if r.path == path)
    predicted = rowset.predict(row).step_time_s
    assert doc["step_time_s"] == predicted
    assert doc["measured_step_time_s"] == row.measured_s
    assert doc["error"] == pytest.approx(predicted / row.measured_s - 1)
    assert doc["row"] == row.id and doc["engine"] == row.flags[row.flags.index("--engine") + 1]


def test_plan_with_the_rows_flags_gives_the_same_layout_and_time(tmp_path):
    """A row whose pinned layout fits: `plan` with its flags (run from the row's folder, as its relative paths
    say) returns that layout, and its prediction is the row's."""
    path = REPO / "bench" / "rows" / "published" / "foundry-mpt13b-s1024-g8.json"
    flags = json.loads(path.read_text())["plan"]
    res = invoke_cli("plan", *flags, "--json", cwd=path.parent)
    assert res.code == 0, res.stderr
    planned = json.loads(res.stdout)
    sim = json.loads(invoke_cli("simulate", str(path), "--json").stdout)
    assert planned["parallel"] == sim["parallel"]
    assert planned["prediction"]["step_time_s"] == sim["step_time_s"]


def test_row_paths_are_relative_to_the_row_file(tmp_path):
    """Run from elsewhere, with the row copied beside its model file: the --model path still resolves."""
    src = REPO / "bench" / "rows" / "dgxc" / "dgxc-v24.11.1-gpt3-175b-1024g-bf16.json"
    (tmp_path / "rows").mkdir()
    (tmp_path / "models").mkdir()
    shutil.copy(src, tmp_path / "rows" / src.name)
    shutil.copy(REPO / "bench" / "rows" / "models" / "gpt-3-175b.json", tmp_path / "models")
    here = json.loads(invoke_cli("simulate", str(src), "--json").stdout)["step_time_s"]
    res = invoke_cli("simulate", str(tmp_path / "rows" / src.name), "--json", cwd=tmp_path)
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["step_time_s"] == here


def test_human_output_names_measured_and_predicted():
    res = invoke_cli("simulate", str(REPO / "bench" / "rows" / "dgxc" / "dgxc-v24.11.1-gpt3-175b-1024g-bf16.json"))
    assert res.code == 0, res.stderr
    assert "row dgxc-v24.11.1-gpt3-175b-1024g-bf16: measured 9.01 s per step" in res.stdout
    assert "where the step goes" in res.stdout


def test_not_expressible_row_is_a_usage_error():
    res = invoke_cli("simulate", str(REPO / "bench" / "rows" / "dgxc" / "dgxc-v25.04-llama31-405b-64g-bf16-proxy.json"))
    assert res.code == 2
    assert "is not expressible: 30 layers over pp*vp = 32 chunks" in res.stderr


def _write(tmp_path, doc) -> str:
    path = tmp_path / "row.json"
    path.write_text(json.dumps(doc))
    return str(path)


GOOD = {"row_version": 1, "id": "r", "source": {"name": "t"},
        "plan": ["--model", "8B", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64"],
        "measured": {"step_time_s": 1.0}}


@pytest.mark.parametrize(("change", "message"), [
    ({"row_version": 9}, "has row_version 9; this meshplan reads 1"),
    ({"plan": "--tp 2"}, "plan must be a list of `meshplan plan` flags"),
    ({"measured": {"tokens": 3}}, "measured must hold step_time_s"),
    ({"plan": None}, "plan is null but not_expressible does not say why"),
    ({"plan": [*GOOD["plan"], "--tpp", "2"]}, "its flags are not valid `meshplan plan` flags: No such option '--tpp'"),
    ({"plan": [*GOOD["plan"], "--tp", "3"]}, "--tp 3 must divide the attention heads (32)"),
])
def test_malformed_row_is_a_usage_error(tmp_path, change, message):
    res = invoke_cli("simulate", _write(tmp_path, {**GOOD, **change}))
    assert res.code == 2, res.stdout
    assert message in res.stderr and "Traceback" not in res.stderr
    assert "row.json" in res.stderr or "row r" in res.stderr


def test_partly_pinned_row_takes_plans_best_layout(tmp_path):
    """No micro-batch stated: the prediction is `plan`'s best layout with the row's pins."""
    path = _write(tmp_path, {**GOOD, "plan": [*GOOD["plan"], "--tp", "2"]})
    sim = json.loads(invoke_cli("simulate", path, "--json").stdout)
    planned = json.loads(invoke_cli("plan", *GOOD["plan"], "--tp", "2", "--json").stdout)
    assert sim["parallel"]["tp"] == 2 and sim["parallel"] == planned["parallel"]
    assert sim["step_time_s"] == planned["prediction"]["step_time_s"]


def test_readme_row_example_is_real_output():
    """The README's `meshplan simulate ROW.json` example: its step line and its verdict are what the row gives."""
    import re

    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("$ meshplan simulate bench/rows/"):]
    block = block[:block.index("```")]
    path = block.split()[3]
    doc = json.loads(invoke_cli("simulate", str(REPO / path), "--json").stdout)
    assert f"step {doc['step_time_s']:.3f} s" in block
    verdict = re.search(r"measured ([\d.]+) s per step .*?predicted\s+([\d.]+) s \(([-+][\d.]+)%\)", block, re.S)
    assert verdict, block
    assert float(verdict[1]) == pytest.approx(doc["measured_step_time_s"], abs=5e-4)
    assert float(verdict[2]) == pytest.approx(doc["step_time_s"], abs=5e-4)
    assert float(verdict[3]) == pytest.approx(100 * doc["error"], abs=0.05)
