"""`meshplan report` on synthetic run directories: parsing, warm-up, last-entry-wins, errors.

The run directory is written by the test (metrics.jsonl + plan.json in the
format ARCHITECTURE.md fixes), so every expected number below is worked out by
hand from the rows the test wrote.
"""

from __future__ import annotations

import json

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, Prediction, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.hardware import GIB


def _plan(prediction: Prediction | None = None, cluster: str = "dgx-h100") -> Plan:
    model = load_model("debug")
    layout = with_stage_layers(model, Layout(dp_shard=4, zero_stage=3, micro_batch_size=2))
    return Plan(model=model, cluster=load_cluster(cluster, 4),
                training=TrainingSpec(seq_len=64, global_batch_size=8, dtype="fp32" if cluster == "cpu" else "bf16"),
                layout=layout, prediction=prediction)


PREDICTION = Prediction(
    step_time_s=0.5, tokens_per_s=1024.0, model_tflops_per_gpu=0.0, mfu=0.0, peak_memory_bytes=3 * GIB,
    memory_breakdown_bytes={"params": GIB // 2, "grads": GIB // 2, "optimizer": 0, "activations": GIB + GIB // 2,
                            "comm_buffers": 0, "other": GIB // 2},
    time_breakdown_s={"compute": 0.4, "exposed_comm": 0.1},
)


def _run_dir(tmp_path, rows, prediction=PREDICTION, raw_tail: str = "", cluster: str = "dgx-h100"):
    _plan(prediction, cluster).save(tmp_path / "plan.json")
    text = "".join(json.dumps(r) + "\n" for r in rows) + raw_tail
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def _row(step, t, peak=2 * GIB, loss=5.0):
    return {"step": step, "loss": loss, "lr": 1e-3, "step_time_s": t, "tokens_per_s": 512 / t, "mfu": 0.0,
            "peak_memory_bytes": peak}


def test_warmup_skipped_and_last_entry_per_step_wins(tmp_path):
    from executor.validate.report import build_report

    # steps 1-2 are warm-up (slow); step 4 was re-run after a resume: its second entry (0.4 s) counts.
    rows = [_row(1, 9.0), _row(2, 3.0), _row(3, 0.6), _row(4, 7.0), _row(5, 0.5), _row(4, 0.4, peak=4 * GIB)]
    report, _ = build_report(_run_dir(tmp_path, rows))
    assert report["warmup_steps"] == 2 and report["steps_counted"] == 3
    meas = report["measured"]
    assert meas["step_time_s"] == pytest.approx(0.5)  # median of 0.6, 0.4, 0.5
    assert meas["tokens_per_s"] == pytest.approx(8 * 64 / 0.5)  # 512 tokens a step
    assert meas["peak_memory_bytes"] == 4 * GIB  # max over counted steps
    err = report["error"]
    assert err["step_time_s"] == pytest.approx(0.0)
    assert err["tokens_per_s"] == pytest.approx((1024 - 1024) / 1024)
    # the executor records allocator bytes: compared with the prediction without `other` (2.5 GiB)
    assert report["predicted"]["tensor_peak_bytes"] == 2.5 * GIB
    assert err["peak_memory_bytes"] == pytest.approx((2.5 - 4) / 4)


def test_mfu_uses_the_plans_model_flops_and_gpu_peak(tmp_path):
    from executor.validate.report import build_report

    report, _ = build_report(_run_dir(tmp_path, [_row(s, 0.25) for s in range(1, 6)]))
    plan = _plan()
    flops_per_token = plan.model.model_flops_per_token(64)
    expected_tflops = flops_per_token * 512 / 0.25 / 4 / 1e12
    assert report["measured"]["model_tflops_per_gpu"] == pytest.approx(expected_tflops)
    assert report["measured"]["mfu"] == pytest.approx(expected_tflops * 1e12 / plan.cluster.gpu.peak_flops("bf16"))
    assert report["error"]["step_time_s"] == pytest.approx((0.5 - 0.25) / 0.25)


def test_truncated_last_line_is_ignored_and_zero_peak_is_null(tmp_path):
    from executor.validate.report import build_report

    rows = [_row(s, 0.5, peak=0) for s in range(1, 4)]
    report, _ = build_report(_run_dir(tmp_path, rows, raw_tail='{"step": 4, "loss'))
    assert report["steps_total"] == 3 and report["warmup_steps"] == 2
    assert report["measured"]["peak_memory_bytes"] is None
    assert report["error"]["peak_memory_bytes"] is None


def test_cpu_runs_record_rss_which_is_not_compared(tmp_path):
    from executor.validate.report import build_report

    report, _ = build_report(_run_dir(tmp_path, [_row(s, 0.5) for s in range(1, 5)], cluster="cpu"))
    assert report["measured"]["peak_memory_bytes"] == 2 * GIB
    assert report["error"]["peak_memory_bytes"] is None and report["error"]["step_time_s"] == 0.0


def test_short_runs_keep_one_step(tmp_path):
    from executor.validate.report import build_report

    report, _ = build_report(_run_dir(tmp_path, [_row(1, 2.0), _row(2, 1.0)]))
    assert report["warmup_steps"] == 1 and report["measured"]["step_time_s"] == 1.0


def test_cli_json_keys_and_png(cli, tmp_path):
    run = _run_dir(tmp_path, [_row(s, 0.5 + 0.01 * s) for s in range(1, 7)])
    png = tmp_path / "r.png"
    r = cli("report", str(run), "--json", "--png", str(png))
    assert r.code == 0, r.stderr
    doc = r.json()
    for key in ("predicted", "measured", "error"):
        assert {"step_time_s", "peak_memory_bytes", "tokens_per_s", "mfu"} <= set(doc[key])
    assert doc["measured"]["step_time_s"] == pytest.approx(0.545)  # median of steps 3-6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_of_two_runs(tmp_path):
    """The chart's series are the runs' rows; the figure draws them, the predictions and the memory bars."""
    from executor.validate.report import build_report
    from executor.validate.report_chart import draw_report_chart, report_chart

    first = [_row(s, 0.5, loss=6.0 - 0.1 * s) for s in range(1, 7)]
    second = [_row(1, 1.0, loss=6.0), _row(2, 0.25, loss=5.5), _row(3, 0.25, loss=None), _row(4, 0.3, loss=5.2)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    built = [build_report(_run_dir(tmp_path / "a", first)), build_report(_run_dir(tmp_path / "b", second))]
    chart = report_chart(built)
    a, b = chart.runs
    assert (a.label, b.label) == ("a", "b") and chart.title == "2 runs of debug"
    assert a.steps == tuple(range(1, 7)) and a.loss == tuple(r["loss"] for r in first)
    assert a.tokens_per_s == pytest.approx([512 / 0.5] * 6)  # 8 sequences of 64 tokens a step
    assert a.counted == (False, False, True, True, True, True)  # two warm-up steps
    assert b.counted == (False, False, True, True)
    assert b.loss[2] is None and b.measured_step_time_s == pytest.approx(0.275)  # median of 0.25 and 0.3
    assert a.predicted_step_time_s == 0.5 and a.step_time_error == pytest.approx(0.0)
    assert a.predicted_peak_bytes == 2.5 * GIB and a.memory_compared and a.measured_peak_bytes == 2 * GIB
    fig = draw_report_chart(chart)
    ax_loss, ax_tps, ax_time, ax_mem = fig.axes
    loss_line = next(line for line in ax_loss.lines if line.get_label() == "a")
    assert list(loss_line.get_ydata()) == pytest.approx([r["loss"] for r in first])
    b_line = next(line for line in ax_loss.lines if line.get_label() == "b")
    assert list(b_line.get_xdata()) == [1, 2, 4]  # the step without a loss is not drawn
    predicted = next(line for line in ax_tps.lines if line.get_label() == "a predicted")
    assert predicted.get_ydata()[0] == pytest.approx(1024.0)
    assert (ax_loss.get_xlabel(), ax_loss.get_ylabel(), ax_tps.get_ylabel()) == ("step", "loss", "tokens/s")
    assert [t.get_text() for t in ax_time.texts] == ["+0%", "+82%"]  # (0.5 - 0.275) / 0.275
    assert [t.get_text() for t in ax_time.get_xticklabels()] == ["a", "b"]
    assert "2.5" in [t.get_text() for t in ax_mem.texts] and "2" in [t.get_text() for t in ax_mem.texts]
    fig.clf()


def test_cli_several_runs(cli, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = _run_dir(tmp_path / "a", [_row(s, 0.5) for s in range(1, 5)])
    b = _run_dir(tmp_path / "b", [_row(s, 0.25) for s in range(1, 5)])
    r = cli("report", str(a), str(b), "--json")
    assert r.code == 0, r.stderr
    runs = r.json()["runs"]
    assert [d["measured"]["step_time_s"] for d in runs] == [0.5, 0.25]
    human = cli("report", str(a), str(b), "--png", str(tmp_path / "runs.png"))
    assert human.code == 0 and str(a) in human.stdout and str(b) in human.stdout
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
    refused = cli("report", str(a), str(b), "--update-calibration", str(tmp_path / "p.json"))
    assert refused.code == 2 and "one run" in refused.stderr and not (tmp_path / "p.json").exists()


def test_cli_human_table(cli, tmp_path):
    r = cli("report", str(_run_dir(tmp_path, [_row(s, 0.5) for s in range(1, 5)])))
    assert r.code == 0, r.stderr
    assert "step_time_s" in r.stdout and "+0.0%" in r.stdout


@pytest.mark.parametrize("case", ["no_dir", "no_metrics", "bad_line", "warmup_too_big"])
def test_bad_input_is_one_line_exit_2(cli, tmp_path, case):
    args = [str(tmp_path / "nope")]
    if case != "no_dir":
        _run_dir(tmp_path, [_row(1, 0.5), _row(2, 0.5)])
        args = [str(tmp_path)]
    if case == "no_metrics":
        (tmp_path / "metrics.jsonl").unlink()
    if case == "bad_line":
        (tmp_path / "metrics.jsonl").write_text("garbage\n" + json.dumps(_row(1, 0.5)) + "\n")
    if case == "warmup_too_big":
        args += ["--warmup-steps", "2"]
    r = cli("report", *args)
    assert r.code == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_update_calibration_makes_the_simulator_reproduce_the_run(cli, tmp_path):
    """The folded profile, fed back to the simulator (not to our code), gives the measured step time."""
    from planner.memory.estimate import estimate_memory
    from planner.simulate.calibration import load_calibration
    from planner.simulate.step import simulate_step

    plan = _plan()
    measured_s = 2.5 * simulate_step(plan.model, plan.training, plan.layout, plan.cluster).step_time_s
    run = _run_dir(tmp_path, [_row(s, measured_s, peak=3 * GIB) for s in range(1, 5)])
    profile_path = tmp_path / "profile.json"
    r = cli("report", str(run), "--update-calibration", str(profile_path), "--json")
    assert r.code == 0, r.stderr
    update = r.json()["calibration_update"]
    assert update["reached"] and min(update["levers"].values()) > 1.0  # the run was slower than the defaults
    assert "host" in update["levers"]  # the debug model on H100 is host-bound: its host overhead grew most
    # it says what it changed, field by field, before -> after
    before, after = update["changed"]["layer_overhead_s"]
    assert after > before and "layer_overhead_s" in r.stderr and "->" in r.stderr
    profile = load_calibration(profile_path, plan.cluster.gpu)
    again = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, profile)
    assert again.step_time_s == pytest.approx(measured_s, rel=1e-3)
    # the run's peak is max_memory_allocated: what the tensor model misses becomes `other`, and a
    # prediction with the folded profile reproduces it as its allocated figure
    est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
    assert profile.other_bytes == 3 * GIB - est.allocated_bytes
    folded = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine,
                             profile.other_bytes)
    assert folded.peak_bytes == 3 * GIB + est.reserve_bytes
    # folding the same run again changes nothing (the rule is idempotent)
    assert cli("report", str(run), "--update-calibration", str(profile_path)).code == 0
    assert load_calibration(profile_path, plan.cluster.gpu).gemm_efficiency == pytest.approx(profile.gemm_efficiency,
                                                                                             rel=1e-3)

