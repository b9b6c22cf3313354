"""executor.components.measure: one measurement for summary.json and `report`; hostile metrics rows."""

from __future__ import annotations

import json

import pytest

from executor.components.measure import counted_rows, flops_dtype, measure, read_metrics, warmup_steps
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError


def _plan(cluster: str = "dgx-h100") -> Plan:
    model = load_model("debug")
    return Plan(model=model, cluster=load_cluster(cluster, 4),
                training=TrainingSpec(seq_len=64, global_batch_size=8, dtype="fp32" if cluster == "cpu" else "bf16"),
                layout=with_stage_layers(model, Layout(dp_shard=4, zero_stage=3, micro_batch_size=2)))


def _write(tmp_path, lines) -> object:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _row(step, t=1.0, loss=5.0, **extra):
    return {"step": step, "step_time_s": t, "loss": loss, "peak_memory_bytes": 100, **extra}


def test_bad_step_times_are_skipped_and_bad_losses_dropped_with_warnings(tmp_path):
    warnings = []
    path = _write(tmp_path, [_row(1), _row(2, t=-1.0), _row(3, t="fast"), _row(4, loss="low"), _row(5, loss=None),
                             _row(6, t=2.0, peak_memory_bytes=-5)])
    rows = read_metrics(path, warn=warnings.append)
    assert [r["step"] for r in rows] == [1, 4, 5, 6]
    assert rows[1]["loss"] is None and rows[3]["peak_memory_bytes"] is None
    assert len(warnings) == 3
    assert "skipped 2 line(s) whose step_time_s" in warnings[0] and "line 2" in warnings[0]
    assert any("ignored loss on 1 line(s)" in w for w in warnings)


@pytest.mark.parametrize("line, expect", [
    ('{"step": true, "step_time_s": 1}', "steps are integers"),
    ('{"step": 0, "step_time_s": 1}', "steps are integers"),
    ('{"step": 1.5, "step_time_s": 1}', "steps are integers"),
    ('[1, 2]', "lacks the keys"),
    ("[" * 200_000, "not valid JSON"),
])
def test_malformed_lines_name_the_line(tmp_path, line, expect):
    path = _write(tmp_path, [line, _row(2)])
    with pytest.raises(UsageError, match=expect) as err:
        read_metrics(path)
    assert "line 1" in str(err.value)


def test_the_first_step_after_a_resume_is_not_counted(tmp_path):
    rows = read_metrics(_write(tmp_path, [_row(s, t=1.0) for s in range(1, 5)]
                               + [_row(5, t=9.0, resumed=True), _row(6, t=1.0), _row(7, t=1.0)]))
    skip = warmup_steps(len(rows), None)
    assert skip == 2
    assert [r["step"] for r in counted_rows(rows, skip)] == [3, 4, 6, 7]
    m = measure(_plan(), rows, skip)
    assert m["step_time_s"] == 1.0 and m["step_time_max_s"] == 1.0 and m["steps_counted"] == 4


def test_mfu_divides_by_the_matmul_dtype_peak():
    assert flops_dtype(_plan("cpu")) == "fp32"
    assert flops_dtype(_plan()) == "bf16"


def test_summary_and_report_measure_alike(tmp_path):
    from executor.validate.report import build_report

    plan = _plan()
    plan.save(tmp_path / "plan.json")
    _write(tmp_path, [_row(s, t=1.0 + (s == 1), loss=6.0 - s / 10) for s in range(1, 7)])
    report, _ = build_report(tmp_path)
    from executor.components.metrics import summarize

    summary = summarize(plan, read_metrics(tmp_path / "metrics.jsonl"), "cpu")
    for key in ("step_time_s", "tokens_per_s", "mfu", "loss_first", "loss_last", "peak_memory_bytes"):
        assert summary["measured"][key] == report["measured"][key], key
