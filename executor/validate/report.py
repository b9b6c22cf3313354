"""`meshplan report`: a run's measured step next to its plan's prediction, with the error of each.

Pure Python (no torch): it reads RUN_DIR/metrics.jsonl and RUN_DIR/plan.json,
the run directory format `meshplan execute` writes (ARCHITECTURE.md).

Measured figures come from `executor.components.measure` (the same function
summary.json uses: rows, warm-up, resumed steps, MFU denominator are defined
there). The throughput figures are derived from the step time with the same formulas
the simulator uses for its prediction, so the errors compare like with like.

Memory: the executor records torch.cuda.max_memory_allocated, i.e. tensor
bytes, without the CUDA context, NCCL buffers and allocator slack that the
memory model's `other` category stands for. So the peak-memory error compares
the measurement with predicted.tensor_peak_bytes (the prediction without
`other`). CPU runs record the process's resident set (the interpreter and
libraries included): not comparable, so their memory error is null.

error[k] = (predicted[k] - measured[k]) / measured[k]: +0.10 means the plan
promised 10% more than the run gave (for step time: predicted 10% too slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from executor.components.measure import measure, read_metrics, warmup_steps
from planner.plan import Plan, Prediction, load_plan
from topologies.errors import UsageError
from topologies.hardware import GIB

COMPARED = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes")
THROUGHPUT = COMPARED[:-1]


def predicted(plan: Plan) -> Prediction:
    """The plan's own prediction; re-simulated when the plan was saved without one."""
    if plan.prediction is not None:
        return plan.prediction
    from planner.simulate.step import simulate_step

    return simulate_step(plan.model, plan.training, plan.layout, plan.cluster, engine=plan.engine).prediction()


def _relative(p: float | None, m: float | None) -> float | None:
    return (p - m) / m if p is not None and m else None


def relative_errors(plan: Plan, pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, float | None]:
    """(predicted - measured) / measured for each compared figure; None when either is missing.

    Peak memory: tensor bytes against tensor bytes on GPUs, nothing on CPU (module docstring).
    """
    out: dict[str, float | None] = {k: _relative(pred.get(k), meas.get(k)) for k in THROUGHPUT}
    gpu_run = plan.cluster.gpu.kind != "cpu"
    out["peak_memory_bytes"] = _relative(pred["tensor_peak_bytes"], meas["peak_memory_bytes"]) if gpu_run else None
    return out


def build_report(run_dir: str | Path, warmup: int | None = None) -> tuple[dict[str, Any], list[dict]]:
    """The report document (the `--json` output) and the metric rows it was built from."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / "plan.json").is_file():
        raise UsageError(f"{str(run_dir)!r} is not a run directory (no plan.json): give the --out directory of "
                         "`meshplan execute PLAN.json --out DIR`")
    plan = load_plan(run_dir / "plan.json")
    from topologies.terminal import log

    rows = read_metrics(run_dir / "metrics.jsonl", warn=lambda message: log(f"warning: {message}"))
    skip = warmup_steps(len(rows), warmup)
    pred = predicted(plan).to_json()
    pred_figures = {k: pred.get(k) for k in COMPARED}
    breakdown = pred.get("memory_breakdown_bytes") or {}
    pred_figures["tensor_peak_bytes"] = pred["peak_memory_bytes"] - int(breakdown.get("other", 0))
    pred_figures["memory_breakdown_bytes"] = breakdown
    pred_figures["time_breakdown_s"] = pred.get("time_breakdown_s")
    meas = measure(plan, rows, skip)
    layout = plan.layout
    return {
        "run_dir": str(run_dir),
        "model": plan.model.name,
        "cluster": f"{plan.cluster.name} ({plan.cluster.n_nodes} x {plan.cluster.gpus_per_node} {plan.cluster.gpu.name})",
        "layout": {k: getattr(layout, k) for k in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "zero_stage",
                                                   "micro_batch_size", "grad_accum_steps", "recompute")},
        "steps_total": len(rows),
        "warmup_steps": skip,
        "steps_counted": meas["steps_counted"],
        "predicted": pred_figures,
        "measured": meas,
        "error": relative_errors(plan, pred_figures, meas),
    }, rows


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "peak_memory_bytes":
        return f"{value / GIB:.2f} GiB"
    if key == "step_time_s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.3g}"


def render_report(report: dict[str, Any]) -> None:
    """The human view: one table, predicted | measured | error for each figure."""
    from rich.table import Table

    from topologies.terminal import console

    table = Table(title=f"{report['run_dir']}: {report['model']} on {report['cluster']}, {report['steps_counted']} steps counted "
                        f"(first {report['warmup_steps']} skipped as warm-up)")
    for col in ("figure", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for key in COMPARED:
        err = report["error"][key]
        predicted = report["predicted"]["tensor_peak_bytes" if key == "peak_memory_bytes" else key]
        label = "peak_memory_bytes (tensors)" if key == "peak_memory_bytes" else key
        table.add_row(label, _fmt(key, predicted), _fmt(key, report["measured"][key]),
                      "-" if err is None else f"{100 * err:+.1f}%")
    meas = report["measured"]
    out = console()
    out.print(table)
    if meas.get("loss_first") is not None:
        out.print(f"loss {meas['loss_first']:.4f} -> {meas['loss_last']:.4f} over the counted steps; "
                  f"step time {_fmt('step_time_s', meas['step_time_min_s'])} .. "
                  f"{_fmt('step_time_s', meas['step_time_max_s'])}")
