"""`meshplan calibrate | report | validate-memory`: checking the planner against reality.

Thin click layers over `executor.calibrate.run`, `executor.validate.report` and
`executor.validate.memory`. torch is imported inside the verbs that need it
(calibrate, validate-memory), never by `report`.
"""

from __future__ import annotations

from pathlib import Path

import click

from topologies.terminal import emit_json, log


@click.command(epilog="\b\nExamples:\n  meshplan calibrate --quick --out h100.json\n  meshplan plan --model 8B --gpus 8 --calibration h100.json\n")
@click.option("--out", "out", type=click.Path(dir_okay=False), default="profile.json", show_default=True,
              help="Where to write the calibration profile (JSON).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Device to measure; default cuda when a GPU is visible, else cpu.")
@click.option("--quick", is_flag=True, help="A small grid: under 2 minutes on a 2-core CPU.")
@click.option("--max-ranks", type=click.IntRange(min=1, max=1024), default=None,
              help="Largest collective group to measure (default: all local GPUs; on CPU min(cores, 4)).")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON only.")
@click.option("--model", "model_name", default=None,
              help="Also measure the shapes this model's layouts run (preset, alias or config path): GEMMs at "
                   "its TP shards and micro-batches, its attention, its message sizes.")
@click.option("--seq-len", type=click.IntRange(min=1), default=None,
              help="Sequence length for --model (default: its native context, at most 4096).")
@click.option("--micro-batch", "micro_batches", type=click.IntRange(min=1), multiple=True,
              help="Micro-batch size(s) for --model (repeatable; default 1 and 2).")
@click.option("--grid", "grid_name", type=click.Choice(["tiny", "quick", "full"]), default=None, hidden=True,
              help="Benchmark grid (tests use tiny); overrides --quick.")
def calibrate(out: str, device: str | None, quick: bool, max_ranks: int | None, as_json: bool,
              model_name: str | None, seq_len: int | None, micro_batches: tuple[int, ...],
              grid_name: str | None) -> None:
    """Measure this machine (GEMM, attention, memory bandwidth, collectives) and fit a calibration profile.

    The profile is what `plan`, `compare` and `simulate` accept with --calibration.
    """
    from executor.calibrate.run import run_calibration
    from topologies.files import check_output

    check_output(out, "--out", stdout_ok=False)  # before minutes of measuring, not after
    model = None
    if model_name is not None:
        from planner.model.load import load_model

        model = load_model(model_name)
    elif seq_len is not None or micro_batches:
        from topologies.errors import UsageError

        raise UsageError("--seq-len and --micro-batch describe the shapes of --model: add --model NAME")
    profile, summary = run_calibration(device=device, quick=quick, max_ranks=max_ranks, out=Path(out),
                                       grid_name=grid_name, model=model, seq_len=seq_len,
                                       micro_batches=micro_batches or (1, 2), quiet=as_json)
    if as_json:
        emit_json(profile.to_json())
        return
    from executor.calibrate.run import render_summary

    render_summary(summary, out)


@click.command(epilog="\b\nExamples:\n  meshplan report runs/p\n  meshplan report runs/p --png report.png --update-calibration h100.json\n  meshplan report runs/ddp runs/fsdp runs/tp2 --png runs.png\n")
@click.argument("run_dirs", metavar="RUN_DIR...", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON only: predicted, measured, error (several runs: {\"runs\": [...]}).")
@click.option("--png", "png", type=click.Path(dir_okay=False), default=None,
              help="Write a chart: loss and tokens/s over steps, step time and peak memory against the prediction; "
                   "several runs overlaid.")
@click.option("--update-calibration", "profile_path", type=click.Path(dir_okay=False), default=None,
              help="Fold this run into a calibration profile (created from the GPU's defaults if absent; one run).")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=None,
              help="Leading steps to skip (default 2 when at least 3 remain).")
def report(run_dirs: tuple[str, ...], as_json: bool, png: str | None, profile_path: str | None,
           warmup_steps: int | None) -> None:
    """Runs' measured step time, tokens/s, MFU and peak memory next to their plans' predictions."""
    from executor.validate.report import build_report, render_report
    from topologies.errors import UsageError
    from topologies.files import check_output

    check_output(png, "--png", image=True)
    check_output(profile_path, "--update-calibration", stdout_ok=False)
    if profile_path and len(run_dirs) > 1:
        raise UsageError(f"--update-calibration folds one run into a profile; got {len(run_dirs)} run directories: "
                         "give one at a time")
    built = [build_report(run_dir, warmup_steps) for run_dir in run_dirs]
    docs = [doc for doc, _ in built]
    if profile_path:
        from executor.calibrate.fit import update_profile_from_run

        update = update_profile_from_run(Path(run_dirs[0]) / "plan.json", docs[0]["measured"], Path(profile_path))
        docs[0]["calibration_update"] = update
        from executor.calibrate.fold import describe

        log(f"updated {profile_path}: time of " + describe(update)
            + (f"; other_bytes {update['other_bytes']:,}" if "other_bytes" in update else ""))
    if png:
        from executor.validate.report_chart import plot_report_chart, report_chart

        plot_report_chart(report_chart(built), png)
        log(f"wrote {png}")
    if as_json:
        emit_json(docs[0] if len(docs) == 1 else {"runs": docs})
    else:
        for doc in docs:
            render_report(doc)


@click.command("validate-memory", epilog="\b\nExamples:\n  meshplan validate-memory plan.json\n  meshplan validate-memory plan.json --rank 0 --rank 7 --json\n")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
@click.option("--rank", "ranks", type=int, multiple=True,
              help="Rank(s) to check (default: rank 0 and the first rank of the worst pipeline stage).")
def validate_memory(plan_path: str, as_json: bool, ranks: tuple[int, ...]) -> None:
    """Run one training step of the plan's real model for one rank of its full world, on CPU under a
    fake process group and FakeTensorMode, and compare PyTorch's memory tracker with the prediction."""
    from topologies.terminal import Progress

    with Progress("validate-memory", unit="ranks", quiet=as_json) as bar:
        bar.describe("importing torch")
        from executor.validate.memory import render_validation, validate_plan_file

        doc = validate_plan_file(plan_path, ranks or None, progress=bar)
    if as_json:
        emit_json(doc)
    else:
        render_validation(doc)
