"""Ctrl-C during `meshplan execute`: one line, exit 130, summary written, no workers left; then the run-dir rules.

The launcher gets SIGINT as a terminal would send it; torchrun's agent
forwards it to the workers (their own sessions), which stop together at a
step boundary. Then: re-running into the same --out is refused, --resume
with fewer --steps is refused unless --allow-plan-change, which continues it
(the first step after the resume is marked), --overwrite starts over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, processes_mentioning, run_cli
from torchrun_util import make_plan


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_ctrl_c_then_resume_then_overwrite(tmp_path):
    plan = make_plan(tmp_path, "z2", gpus=2)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "cli.py"), "execute", str(plan), "--steps", "2000",
                             "--out", str(out), "--checkpoint-every", "2", "--log-every", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 240
        while _lines(out / "metrics.jsonl") < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert _lines(out / "metrics.jsonl") >= 4, "the run did not start"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        leftovers = processes_mentioning([str(out)])
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted at step ") and "last checkpoint step-" in last and "--resume" in last, stderr
    assert not leftovers, f"workers left behind: {leftovers}"
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["interrupted_at_step"] == steps[-1] == int(last.split()[3].rstrip(";"))

    again = run_cli("execute", str(plan), "--steps", "4", "--out", str(out))
    assert again.code == 2 and "already holds a run" in again.stderr

    shorter = ("execute", str(plan), "--steps", str(steps[-1] + 2), "--out", str(out), "--resume")
    refused = run_cli(*shorter)  # another --steps than the checkpoint's run: its LR schedule would not fit
    assert refused.code == 2 and f"(--steps 2000 -> {steps[-1] + 2})" in refused.stderr, refused.stderr
    resumed = run_cli(*shorter, "--allow-plan-change", timeout=240)
    assert resumed.code == 0, resumed.stderr
    assert f"LR schedule rebuilt for --steps {steps[-1] + 2}" in resumed.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("resumed", False) for r in rows].count(True) == 1

    fresh = run_cli("execute", str(plan), "--steps", "2", "--out", str(out), "--overwrite", timeout=240)
    assert fresh.code == 0, fresh.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / "checkpoints").exists()
