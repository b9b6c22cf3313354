"""`meshplan plan --ep/--etp` and `models show` for mixture-of-experts models, as a user runs them."""

from __future__ import annotations

import json

MOE = ("plan", "--model", "mixtral-8x7b", "--gpus", "16", "--engine", "megatron", "--seq-len", "4096",
       "--global-batch", "64")


def test_plan_pins_ep_and_etp_into_plan_json(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli(*MOE, "--tp", "2", "--ep", "8", "--etp", "1", "-o", str(out))
    assert r.code == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["parallel"]["ep"] == 8 and doc["parallel"]["etp"] == 1 and doc["parallel"]["tp"] == 2
    assert doc["model"]["moe"]["n_experts"] == 8


def test_plan_refuses_an_ep_that_does_not_divide_the_experts(cli):
    r = cli(*MOE, "--ep", "3")
    assert r.code == 2 and "--ep 3" in r.stderr and "Traceback" not in r.stderr


def test_meshplan_engine_refuses_unbuilt_moe_naming_other_engines(cli):
    r = cli("plan", "--model", "deepseek-v3", "--gpus", "16")  # MLA and MTP: the executor does not build them
    assert r.code in (2, 3) and "--engine megatron" in (r.stdout + r.stderr)


def test_models_show_prints_total_and_active(cli):
    r = cli("models", "show", "deepseek-v3", "--json")
    assert r.code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert round(doc["total_params"] / 1e9) == 671 and 37 <= doc["active_params"] / 1e9 < 38
    text = cli("models", "show", "deepseek-v3")
    assert "active params" in text.stdout and "total params" in text.stdout
