"""One measurement of a run, shared by summary.json (written by rank 0) and `meshplan report`.

Pure Python (no torch), so `report` stays light. The rules:
  rows            metrics.jsonl, the LAST entry for each step (a resumed run
                  appends, so a re-run step appears twice; the later one ran).
                  A row whose step_time_s is not a finite positive number is
                  skipped, a loss or peak that is not a finite number is
                  dropped from that row; each with a warning saying how many.
  warm-up         the first DEFAULT_WARMUP_STEPS steps (allocator, autotuning,
                  lazy init) when at least one more remains, else all but one;
                  and the first step after every resume (`"resumed": true`,
                  written by MetricsLog), which pays the same warm-up again.
  step_time_s     median of the counted steps (robust to one slow step)
  tokens_per_s    tokens_per_step / step_time_s
  model_tflops_per_gpu  model_flops_per_token * tokens_per_s / world_size / 1e12
  mfu             model_tflops_per_gpu * 1e12 / peak FLOP/s of the dtype the
                  matmuls run in (the plan's dtype; fp32 on CPU ranks)
  peak_memory_bytes  max over the counted steps; None when none was recorded
  loss_first, loss_last  the counted steps' first and last finite loss
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from topologies.errors import UsageError

DEFAULT_WARMUP_STEPS = 2
REQUIRED_KEYS = ("step", "step_time_s")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(path: Path, warn=None) -> list[dict[str, Any]]:
    """metrics.jsonl rows, validated (module docstring), the last entry per step, ordered by step.

    A line cut short by a crash (the last one) is skipped; a line that is not a
    JSON object with a positive integer step is a UsageError naming the line.
    `warn(message)` receives one line per kind of skipped or dropped value.
    """
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise UsageError(f"{str(path)!r} does not exist: is this a run directory written by "
                         "`meshplan execute ... --out DIR`?") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {str(path)!r}: {exc}") from None
    by_step: dict[int, dict[str, Any]] = {}
    bad_time: list[int] = []
    dropped: dict[str, list[int]] = {}
    resumed_at: set[int] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if number == len(lines):
                continue
            raise UsageError(f"{path}: line {number} is not valid JSON; fix or delete that line") from None
        missing = [k for k in REQUIRED_KEYS if not isinstance(row, dict) or k not in row]
        if missing:
            raise UsageError(f"{path}: line {number} lacks the keys {', '.join(missing)}")
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise UsageError(f"{path}: line {number} has step {step!r}; steps are integers from 1")
        if not _finite(row["step_time_s"]) or row["step_time_s"] <= 0:
            bad_time.append(number)
            continue
        row = dict(row)
        for key in ("loss", "peak_memory_bytes", "mfu"):
            if key in row and row[key] is not None and (not _finite(row[key]) or (key != "loss" and row[key] < 0)):
                dropped.setdefault(key, []).append(number)
                row[key] = None
        if row.get("resumed") is True:
            resumed_at.add(step)
        by_step[step] = row
    if warn is not None:
        if bad_time:
            warn(f"{path}: skipped {len(bad_time)} line(s) whose step_time_s is not a positive number "
                 f"(first: line {bad_time[0]})")
        for key, numbers in dropped.items():
            warn(f"{path}: ignored {key} on {len(numbers)} line(s) where it is not a valid number "
                 f"(first: line {numbers[0]})")
    if not by_step:
        raise UsageError(f"{path} holds no usable optimizer steps: run `meshplan execute` with --steps >= 1")
    rows = [by_step[s] for s in sorted(by_step)]
    for row in rows:
        row["resumed"] = row["step"] in resumed_at
    return rows


def warmup_steps(n_steps: int, requested: int | None) -> int:
    """How many leading steps to skip: the request, else the default, always leaving one."""
    if requested is not None:
        if requested < 0:
            raise UsageError(f"--warmup-steps must be >= 0, got {requested}")
        if requested >= n_steps:
            raise UsageError(f"--warmup-steps {requested} leaves none of the run's {n_steps} steps")
        return requested
    return DEFAULT_WARMUP_STEPS if n_steps > DEFAULT_WARMUP_STEPS else max(0, n_steps - 1)


def counted_rows(rows: list[dict[str, Any]], skip: int) -> list[dict[str, Any]]:
    """The steps a measurement counts: past the warm-up, and not the first step after a resume."""
    counted = [r for r in rows[skip:] if not r.get("resumed")]
    return counted or rows[skip:] or rows[-1:]


def flops_dtype(plan) -> str:
    """The dtype whose peak FLOP/s MFU divides by: what the matmuls run in (fp32 on CPU ranks)."""
    return "fp32" if plan.cluster.gpu.kind == "cpu" else plan.training.dtype


def measure(plan, rows: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """The measured figures of the counted steps (module docstring); `plan` is a planner.plan.Plan."""
    counted = counted_rows(rows, skip)
    times = [float(r["step_time_s"]) for r in counted]
    step_time_s = statistics.median(times)
    tokens_per_s = plan.training.tokens_per_step / step_time_s
    tflops = plan.model.model_flops_per_token(plan.training.seq_len) * tokens_per_s / plan.world_size / 1e12
    peaks = [int(r["peak_memory_bytes"]) for r in counted if r.get("peak_memory_bytes")]
    losses = [float(r["loss"]) for r in counted if _finite(r.get("loss"))]
    return {
        "steps": len(rows),
        "steps_counted": len(counted),
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops * 1e12 / plan.cluster.gpu.peak_flops(flops_dtype(plan)),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }
