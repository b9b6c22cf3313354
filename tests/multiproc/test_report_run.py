"""Multi-process part of test_report.py: real torchrun ranks on gloo."""

from __future__ import annotations

import json

import pytest


def test_report_on_a_real_executor_run(cli, tmp_path):
    """End to end: plan, execute 4 steps on 2 CPU ranks, report; figures recomputed from metrics.jsonl."""
    import statistics

    plan = tmp_path / "p.json"
    assert cli("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "2", "--global-batch", "4",
               "--seq-len", "64", "--dp", "2", "-o", str(plan)).code == 0
    run = tmp_path / "run"
    ex = cli("execute", str(plan), "--steps", "4", "--out", str(run), timeout=300)
    assert ex.code == 0, ex.stderr
    r = cli("report", str(run), "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert doc["steps_counted"] == 2 and doc["warmup_steps"] == 2
    assert doc["measured"]["step_time_s"] == pytest.approx(statistics.median(r["step_time_s"] for r in rows[2:]))
    assert doc["predicted"]["step_time_s"] == json.loads(plan.read_text())["prediction"]["step_time_s"]
    assert doc["error"]["peak_memory_bytes"] is None  # CPU ranks record their resident set
