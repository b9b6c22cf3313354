"""`meshplan simulate plan.json | ROW.json`: re-simulate a plan or a published run, show where the step's time goes.

A thin layer over `planner.simulate.step.simulate_step`; the trace and the chart
come from `planner.simulate.trace` (matplotlib only when --png is given). A row
file (planner.cli.row: `meshplan plan` flags and what the run measured, as the
accuracy benches keep them under bench/rows/) is predicted as every bench
predicts it (`simulate_row`) and printed next to its measurement.
"""

from __future__ import annotations

import click

from topologies.terminal import console, emit_json, gib, log

# The order the breakdown is shown in; the first four sum to the step time.
BREAKDOWN_ROWS = (("compute", "compute"), ("exposed_comm", "exposed communication"), ("bubble", "pipeline bubble"),
                  ("optimizer", "optimizer step"), ("tp_comm", "  of which TP"), ("cp_comm", "  of which CP"),
                  ("ep_comm", "  of which EP"), ("fsdp_comm", "  of which FSDP gathers"),
                  ("offload_comm", "  of which host->GPU weight copies"),
                  ("dp_comm", "  of which DP reduction"), ("param_gather", "  of which parameter gather"),
                  ("embedding_sync", "  of which tied-embedding sync"))


@click.command(epilog="\b\nExamples:\n  meshplan simulate plan.json\n  meshplan simulate plan.json --trace step.json --png step.png\n  meshplan simulate bench/rows/dgxc/dgxc-v25.02-llama31-70b-64g-bf16.json\n")
@click.argument("plan_path", metavar="PLAN.json|ROW.json", type=click.Path(dir_okay=False))
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome/Perfetto trace of one step (open it at ui.perfetto.dev).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Write a Gantt chart of one step to this PNG.")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="Calibration profile JSON (default: the shipped profile of the plan's GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout.")
def simulate(plan_path: str, trace_path: str | None, png_path: str | None, calibration: str | None,
             as_json: bool) -> None:
    """Re-simulate PLAN.json, or predict a published run's ROW.json: step time, its breakdown, memory;
    optionally a trace and a Gantt chart."""
    from planner.cli.row import load_row, row_plan, simulate_row
    from planner.plan import load_plan
    from planner.simulate.calibration import load_calibration
    from planner.simulate.step import simulate_step
    from topologies.files import check_output

    check_output(trace_path, "--trace")
    check_output(png_path, "--png", image=True)
    want_events = bool(trace_path or png_path)
    row = load_row(plan_path) if _is_row_file(plan_path) else None
    if row is not None:
        plan, shipped = row_plan(row)
        cal = load_calibration(calibration, plan.cluster.gpu) if calibration else shipped
        result = simulate_row(row, cal, events=want_events)
    else:
        plan = load_plan(plan_path)
        cal = load_calibration(calibration, plan.cluster.gpu)
        result = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, cal, engine=plan.engine,
                               events=want_events)
    layout = plan.layout
    if trace_path:
        from planner.simulate.trace import write_trace

        write_trace(result, layout.pp_schedule, layout.pp, layout.virtual_stages, trace_path)
        log(f"wrote trace {trace_path}")
    if png_path:
        from planner.simulate.trace import plot_gantt

        c = plan.cluster
        plot_gantt(result, layout.pp_schedule, layout.pp, layout.virtual_stages, png_path,
                   title=f"{plan.model.name} on {c.world_size} x {c.gpu.name} ({c.name}): tp {layout.tp}, pp "
                         f"{layout.pp}, dp {layout.dp}, ZeRO-{layout.zero_stage}")
        log(f"wrote {png_path}")
    prediction = result.prediction()
    measured = row.measured_s if row is not None else None
    if as_json:
        # plan.json's `prediction` keys at the top, then where it came from and what was written
        extra = {"row": row.id, "measured_step_time_s": measured, "error": result.step_time_s / measured - 1,
                 "parallel": plan.layout.to_json(), "engine": plan.engine} if row is not None else {}
        emit_json({**prediction.to_json(),
                   "plan_prediction": plan.prediction.to_json() if plan.prediction else None,
                   "calibration": cal.source, "trace": trace_path, "png": png_path, **extra})
        return
    _print_human(plan, result, cal.source)
    if row is not None:
        console().print(f"row {row.id}: measured {measured:.3f} s per step ({row.source.get('name', 'source')}); "
                        f"predicted {result.step_time_s:.3f} s ({100 * (result.step_time_s / measured - 1):+.1f}%)")


def _is_row_file(path: str) -> bool:
    """A published run's row file (planner.cli.row) rather than a plan.json."""
    import json

    from planner.cli.row import is_row

    try:
        return is_row(json.loads(open(path, encoding="utf-8").read()))
    except (OSError, ValueError, RecursionError):
        return False  # load_plan names what is wrong with it


def _print_human(plan, result, calibration_source: str) -> None:
    from rich.table import Table

    out = console()
    lay = plan.layout
    out.print(f"[bold]{plan.model.name}[/] on {plan.cluster.name} ({plan.cluster.world_size} GPUs): "
              f"tp {lay.tp}, pp {lay.pp} ({lay.pp_schedule}, v={lay.virtual_stages}), "
              f"dp {lay.dp_replicate}x{lay.dp_shard} (ZeRO-{lay.zero_stage}), cp {lay.cp}, "
              f"micro-batch {lay.micro_batch_size} x {lay.grad_accum_steps}, recompute {lay.recompute}, "
              f"engine {plan.engine}")
    out.print(f"step {result.step_time_s:.3f} s   {result.tokens_per_s:,.0f} tokens/s   "
              f"{result.model_tflops_per_gpu:.1f} TFLOP/s per GPU   MFU {100 * result.mfu:.1f}%   "
              f"peak memory {gib(result.memory.peak_bytes)} (stage {result.memory.worst_stage})")
    if plan.prediction is not None:
        before = plan.prediction.step_time_s
        out.print(f"plan.json predicted {before:.3f} s; re-simulated {result.step_time_s:.3f} s "
                  f"({100 * (result.step_time_s / before - 1):+.1f}%)")
    table = Table(title=f"where the step goes (slowest stage: {result.critical_stage})")
    table.add_column("part")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    b = result.time_breakdown_s
    for key, label in BREAKDOWN_ROWS:
        if key in b and (b[key] > 0 or not label.startswith(" ")):
            table.add_row(label, f"{b[key]:.4f}", f"{100 * b[key] / result.step_time_s:.1f}%")
    out.print(table)
    out.print(f"calibration: {calibration_source}")
