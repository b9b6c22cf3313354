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


def test_report_chart_of_real_cpu_runs(cli, tmp_path):
    """Two layouts of the same model and data, 6 steps each on 2 CPU ranks; `report A B --png` draws both runs
    from their metrics.jsonl: the same losses step by step (same seed, same data), each run's tokens/s."""
    from executor.validate.report import build_report
    from executor.validate.report_chart import draw_report_chart, report_chart

    runs = []
    for zero in (0, 3):
        plan = tmp_path / f"z{zero}.json"
        assert cli("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "2", "--global-batch", "4",
                   "--seq-len", "64", "--dp", "2", "--zero", str(zero), "-o", str(plan)).code == 0
        run = tmp_path / f"zero{zero}"
        ex = cli("execute", str(plan), "--steps", "6", "--out", str(run), timeout=300)
        assert ex.code == 0, ex.stderr
        runs.append(run)
    png = tmp_path / "runs.png"
    r = cli("report", *map(str, runs), "--png", str(png))
    assert r.code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chart = report_chart([build_report(run) for run in runs])
    for run, curves in zip(runs, chart.runs, strict=True):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert curves.label == run.name and curves.steps == tuple(range(1, 7))
        assert curves.loss == tuple(row["loss"] for row in rows)
        assert curves.tokens_per_s == pytest.approx([row["tokens_per_s"] for row in rows])
        assert curves.counted == (False, False, True, True, True, True)
        assert not curves.memory_compared and curves.measured_peak_bytes == max(row["peak_memory_bytes"]
                                                                                for row in rows[2:])
        assert curves.predicted_step_time_s == json.loads((run / "plan.json").read_text())["prediction"]["step_time_s"]
    assert chart.runs[0].loss == pytest.approx(chart.runs[1].loss, abs=1e-3)  # DDP and ZeRO-3 train alike
    fig = draw_report_chart(chart)
    ax_loss = fig.axes[0]
    for curves in chart.runs:
        line = next(line for line in ax_loss.lines if line.get_label() == curves.label)
        assert list(line.get_ydata()) == pytest.approx(list(curves.loss))
    fig.clf()
