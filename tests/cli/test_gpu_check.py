"""`make gpu-check` (bench/gpu_check.py) without a GPU: its dry mode checks everything but the GPU.

The dry mode plans every case for an H200 (the lent machine's GPU), records
the command lines, runs `meshplan execute --dry-run` on each model's first
plan and writes the JSON the GPU run writes. Here: the JSON's shape, that
every recorded command line is the one that made the plan on disk, that the
plans are what the check says (one GPU of the planned kind, the 8B
architecture cut to the layers that fit, the case's precision and compile
flag), and that fp8 cases are skipped, with how to carry torchao, exactly
when torchao is missing. Without CUDA and without --dry-run it refuses in one
line; the Makefile target runs the script with .venv's python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from planner.plan import load_plan
from topologies.hardware import get_gpu


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run", "--out", str(out),
                           "--json", str(out / "result.json")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"stdout": proc.stdout, "json": json.loads((out / "result.json").read_text())}


def test_dry_run_writes_the_json_of_a_gpu_run(dry):
    doc = dry["json"]
    assert doc["schema"] == "meshplan-gpu-check/1" and doc["dry_run"] is True
    assert doc["gpu"] == "h200" and doc["cluster"] == ["--cluster", "dgx-h200"]
    env = doc["environment"]
    assert env["cuda"] is None and env["missing"] == [] and env["packages"]["torch"]
    names = [case["name"] for case in doc["cases"]]
    assert names == ["1b-bf16-eager", "8b-bf16-eager", "1b-bf16-compile", "8b-bf16-compile",
                     "1b-fp8-compile", "8b-fp8-compile", "1b-fp8-eager", "8b-fp8-eager"]
    assert dry["stdout"].strip().splitlines()[-1].startswith("gpu-check: h200, torch ")


def test_every_planned_case_holds_its_commands_plan_and_prediction(dry):
    doc = dry["json"]
    h200 = get_gpu("h200")
    torchao = doc["environment"]["torchao"]["available"]
    planned = [c for c in doc["cases"] if c["status"] == "planned"]
    assert {c["precision"] for c in planned} == ({"bf16", "fp8"} if torchao else {"bf16"})
    for case in planned:
        plan_argv, exec_argv = case["commands"]["plan"], case["commands"]["execute"]
        assert plan_argv[:3] == [doc["environment"]["executable"], str(REPO / "cli.py"), "plan"]
        assert plan_argv[plan_argv.index("-o") + 1] == case["plan"]["path"] == exec_argv[3]
        assert ("--compile" in plan_argv) == case["compile"]
        assert plan_argv[plan_argv.index("--precision") + 1] == case["precision"]
        plan = load_plan(case["plan"]["path"])
        assert plan.world_size == 1 and plan.cluster.gpu.name == "h200"
        assert plan.training.precision == case["precision"] and plan.training.compile == case["compile"]
        assert plan.model.n_layers == case["plan"]["layers"]
        pred = case["predicted"]
        assert pred["tokens_per_s"] == plan.prediction.tokens_per_s > 0 and 0 < pred["mfu"] < 1
        assert 0 < pred["peak_allocated_bytes"] <= pred["peak_reserved_bytes"] < h200.memory_bytes
        assert case["measured"] is None and case["reason"] is None
    eight = [c for c in planned if c["model"] == "8b"]
    assert eight and all(c["plan"]["model"].startswith("llama3-8b") for c in eight)
    for case in eight:  # the 8B architecture keeps the most layers that fit, and says so when it cut some
        assert 0 < case["plan"]["layers"] <= 32
        assert ("note" in case["plan"]) == (case["plan"]["layers"] < 32)


def test_fp8_is_skipped_with_how_to_carry_torchao_when_it_is_missing(dry):
    doc = dry["json"]
    status = doc["environment"]["torchao"]
    for case in doc["cases"]:
        if case["precision"] == "fp8" and not status["available"]:
            assert case["status"] == "skipped" and case["reason"].startswith("torchao not importable")
    if not status["available"]:
        assert "pip download --no-deps --only-binary=:all:" in status["how"]
        assert "pip install --no-index --no-deps --target" in status["how"]


def test_without_cuda_the_gpu_run_refuses_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")  # CPU CI always runs it
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no CUDA device here")


def test_make_target_runs_the_script_with_the_venv_or_python3():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    proc = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "GPU_CHECK_ARGS=--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if "bench/gpu_check.py" in x]
    python = ".venv/bin/python" if (REPO / ".venv" / "bin" / "python").exists() else "python3"
    assert line.endswith(f"{python} bench/gpu_check.py --dry-run") and line.startswith(f'PYTHONPATH="{REPO}')
