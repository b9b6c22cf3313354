"""`meshplan simulate plan.json | ROW.json`: re-simulate a plan or a published run, show where the step's time goes.

A thin layer over `planner.simulate.step.simulate_step`; the trace and the chart
come from `planner.simulate.trace` (matplotlib only when --png is given). A row
file (planner.cli.row: `meshplan plan` flags and what the run measured, as the
accuracy benches keep them under bench/rows/) is predicted as every bench
predicts it (`simulate_row`) and printed next to its measurement.
"""

from __future__ import annotations

import click

from topologies.terminal import Progress, console, emit_json, log

# The order the breakdown is shown in; the unindented rows sum to the step time.
BREAKDOWN_ROWS = (("compute", "compute"), ("exposed_comm", "exposed communication"), ("tp_comm", "  of which TP"),
                  ("cp_comm", "  of which CP"), ("ep_comm", "  of which EP"), ("fsdp_comm", "  of which FSDP gathers"),
                  ("offload_comm", "  of which host link copies (offload)"), ("dp_comm", "  of which DP reduction"),
                  ("param_gather", "  of which parameter gather"),
                  ("embedding_sync", "  of which tied-embedding sync"), ("bubble", "pipeline bubble"),
                  ("bubble_schedule", "  of which the schedule's warm-up/cool-down"),
                  ("bubble_imbalance", "  of which stage imbalance"), ("optimizer", "optimizer step"))


@click.command(epilog="\b\nExamples:\n  meshplan simulate plan.json\n  meshplan simulate plan.json --trace step.json --png step.png\n  meshplan simulate bench/rows/dgxc/dgxc-v25.02-llama31-70b-64g-bf16.json\n")
@click.argument("plan_path", metavar="PLAN.json|ROW.json", type=click.Path(dir_okay=False))
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome/Perfetto trace of one step (open it at ui.perfetto.dev).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Write a chart of one step to this PNG: per stage compute (bubble shaded) and each kind of "
                   "communication, the first and last micro-batches drawn, the steady state folded.")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="Calibration profile JSON (default: the shipped profile of the plan's GPU).")
@click.option("--offload", type=click.Choice(("none", "optimizer", "params")), default=None,
              help="Re-simulate the plan with this model state in host memory instead of its own (what-if; "
                   "the engine must run it, the node's RAM must hold it).")
@click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout.")
def simulate(plan_path: str, trace_path: str | None, png_path: str | None, calibration: str | None,
             offload: str | None, as_json: bool) -> None:
    """Re-simulate PLAN.json, or predict a published run's ROW.json: step time, its breakdown, memory;
    optionally a trace and a chart of the step."""
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
    else:
        plan = load_plan(plan_path)
        cal = load_calibration(calibration, plan.cluster.gpu)
    if offload is not None:
        plan = with_offload(plan, offload, row is not None)
    layout = plan.layout
    # a step of thousands of operations, its trace and its chart take seconds on a large plan
    with Progress("simulate", quiet=as_json or not want_events) as bar:
        if row is not None:
            result = simulate_row(row, cal, events=want_events)
        else:
            result = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, cal, engine=plan.engine,
                                   events=want_events)
        timeline = None
        if want_events:
            from planner.simulate.timeline import timeline_of

            timeline = timeline_of(result, layout)
        if trace_path:
            from planner.simulate.trace import write_trace

            bar.describe("writing the trace")
            write_trace(timeline, trace_path)
        if png_path:
            from planner.charts.timeline import plot_step_chart, step_chart

            bar.describe("drawing the chart")
            c = plan.cluster
            plot_step_chart(step_chart(timeline, f"{plan.model.name} on {c.world_size} x {c.gpu.name} ({c.name}): "
                                                 f"{layout_words(layout)}"), png_path)
    for path, what in ((trace_path, "trace "), (png_path, "")):
        if path:
            log(f"wrote {what}{path}")
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
    _print_human(plan, result, cal)
    if row is not None:
        from planner.figures import seconds

        console().print(f"row {row.id}: measured {seconds(measured)} per step ({row.source.get('name', 'source')}); "
                        f"predicted {seconds(result.step_time_s)} ({100 * (result.step_time_s / measured - 1):+.1f}%)")


def with_offload(plan, name: str, is_row: bool):
    """The plan with its layout's offload replaced (simulate --offload), checked as a plan is: the engine must
    run it and the offloaded state must fit the node's RAM (planner.simulate.offload)."""
    import dataclasses

    from planner.engines import get_engine
    from planner.memory.states import model_states
    from planner.simulate.offload import host_refusal, host_stated, offload_kind
    from topologies.errors import InfeasibleError, UsageError

    if is_row:
        raise UsageError("--offload re-simulates a plan.json; a row file states what its run used")
    layout = plan.layout.replace(offload=offload_kind(name))
    refusal = get_engine(plan.engine).refusal(plan.model, layout, plan.training.dtype, plan.cluster.gpu.kind != "cpu",
                                              plan.training)
    if refusal:
        raise UsageError(f"simulate --offload {name}: {refusal}")
    if layout.offload != "none":
        if host_stated(plan.cluster):
            raise UsageError(host_stated(plan.cluster))
        host = host_refusal(model_states(plan.model, plan.training, layout, plan.engine).host, plan.cluster)
        if host:
            raise InfeasibleError(f"simulate --offload {name}: {host}")
    return dataclasses.replace(plan, layout=layout, prediction=None)


def _is_row_file(path: str) -> bool:
    """A published run's row file (planner.cli.row) rather than a plan.json."""
    import json

    from planner.cli.row import is_row

    try:
        return is_row(json.loads(open(path, encoding="utf-8").read()))
    except (OSError, ValueError, RecursionError):
        return False  # load_plan names what is wrong with it


def layout_words(layout) -> str:
    """tp 1, pp 4, dp 2, cp 2, ZeRO-1, micro-batch 1 x 128: a layout in a chart's title."""
    dp = f"{layout.dp_replicate}x{layout.dp_shard}" if layout.hsdp else str(layout.dp)
    parts = [f"tp {layout.tp}", f"pp {layout.pp}", f"dp {dp}"] + [f"{axis} {getattr(layout, axis)}"
                                                                 for axis in ("cp", "ep") if getattr(layout, axis) > 1]
    return ", ".join(parts + [f"ZeRO-{layout.zero_stage}",
                              f"micro-batch {layout.micro_batch_size} x {layout.grad_accum_steps}"])


def _print_human(plan, result, cal) -> None:
    from rich.table import Table

    from planner.accuracy.bands import band_words
    from planner.figures import percent, seconds, sig, thousands
    from planner.search.advice import Context, bubble_split
    from topologies.hardware import GIB

    out = console()
    lay = plan.layout
    out.print(f"[bold]{plan.model.name}[/] on {plan.cluster.name} ({plan.cluster.world_size} GPUs): "
              f"tp {lay.tp}, pp {lay.pp} ({lay.pp_schedule}, v={lay.virtual_stages}), "
              f"dp {lay.dp_replicate}x{lay.dp_shard} (ZeRO-{lay.zero_stage}), cp {lay.cp}, "
              f"micro-batch {lay.micro_batch_size} x {lay.grad_accum_steps}, recompute {lay.recompute}, "
              f"engine {plan.engine}")
    out.print(f"step {seconds(result.step_time_s)}   {thousands(result.tokens_per_s)} tokens/s   "
              f"{sig(result.model_tflops_per_gpu)} TFLOP/s per GPU   MFU {percent(result.mfu)}   "
              f"peak memory {sig(result.memory.peak_bytes / GIB)} GiB (stage {result.memory.worst_stage})")
    out.print(f"uncertainty{band_words(plan.engine, plan.cluster.gpu.name, plan.model.moe is not None)}")
    if plan.prediction is not None:
        before = plan.prediction.step_time_s
        out.print(f"plan.json predicted {seconds(before)}; re-simulated {seconds(result.step_time_s)} "
                  f"({100 * (result.step_time_s / before - 1):+.1f}%)")
    table = Table(title=f"where the step goes (slowest stage: {result.critical_stage})")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    b = dict(result.time_breakdown_s)
    split = bubble_split(Context(plan.model, plan.cluster, cal, plan.engine, 0), plan.training, lay)
    if split is not None:  # planner.search.advice: the simulator's idle time by cause
        b["bubble_schedule"], b["bubble_imbalance"] = split.schedule_s, split.imbalance_s
    for key, label in BREAKDOWN_ROWS:
        if key in b and (b[key] > 0 or not label.startswith(" ")):
            table.add_row(label, seconds(b[key]), percent(b[key] / result.step_time_s))
    out.print(table)
    from planner.cli.plan import offload_words

    if result.offload:
        out.print(offload_words(result.offload))
    out.print(f"calibration: {cal.source}")
