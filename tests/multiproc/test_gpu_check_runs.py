"""bench/gpu_check.py's run path on CPU ranks: the one part of `make gpu-check` its dry mode cannot reach.

A GPU run executes each case's plan, measures metrics.jsonl against the
prediction and, at the time budget's deadline, sends SIGINT so the run stops
at a step boundary and is measured on the steps it finished. Here the same
functions run a `debug` plan on 2 CPU ranks: once to the end, once cut by a
deadline that falls mid-run.
"""

from __future__ import annotations

import json
import time

from conftest import load_bench
from torchrun_util import make_plan


def _case(gpu_check, plan_path):
    case = gpu_check.Case("1b", "bf16", False)
    pred = json.loads(plan_path.read_text())["prediction"]
    case.plan = {"path": str(plan_path)}
    case.predicted = {"step_time_s": pred["step_time_s"], "tokens_per_s": pred["tokens_per_s"], "mfu": pred["mfu"],
                      "peak_allocated_bytes": pred.get("allocated_peak_bytes"), "peak_reserved_bytes": None}
    return case


def test_a_case_runs_measures_and_stops_at_the_deadline(tmp_path):
    gpu_check = load_bench("gpu_check")
    plan = make_plan(tmp_path, "ddp", "--dp", "2", "--zero", "0", gpus=2)
    done = _case(gpu_check, plan)
    gpu_check.run_case(done, tmp_path, steps=8, deadline=time.time() + 600)
    assert done.status == "ok", done.reason
    assert done.commands["execute"][2:4] == ["execute", str(plan)]
    m = done.measured
    assert m["steps"] == 8 and m["steps_counted"] == 8 - gpu_check.WARMUP_STEPS
    assert m["tokens_per_s"] > 0 and m["peak_allocated_bytes"] > 0 and m["peak_reserved_bytes"] is None  # CPU
    ratio = done.measured_over_predicted["tokens_per_s"]
    assert ratio == m["tokens_per_s"] / done.predicted["tokens_per_s"]
    cut = _case(gpu_check, plan)
    gpu_check.run_case(cut, tmp_path, steps=100_000, deadline=time.time() + 60)
    assert cut.status == "stopped", cut.reason
    assert 1 <= cut.measured["steps"] < 100_000 and cut.reason.startswith("stopped at the time budget after")
