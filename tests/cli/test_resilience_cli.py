"""`meshplan execute` refusals that must come before any rank starts, and `meshplan checkpoint verify`.

Checkpoints here are written in one process by CheckpointManager (as a run's
rank 0 would in a world of 1); runs with real ranks are in
tests/multiproc/test_resilience.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO
from torchrun_util import make_plan

from executor.components.checkpoint import CheckpointManager


def _write_run(out, steps: int = 6, checkpoints=(2, 4)):
    """A run directory holding checkpoints of the toy model, each with run.json for the debug plan's shape."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_checkpoint import app, toy, train

    model, optim, state = toy()
    info = {"model": "debug", "seq_len": 64, "global_batch_size": 8, "steps": steps}
    mgr = CheckpointManager(out, run_info=info)
    for step in checkpoints:
        train(model, optim, state, step)
        mgr.save(step, app(model, optim, state))
    (out / "metrics.jsonl").write_text("")


def test_second_run_into_one_out_is_refused_before_any_rank(cli, tmp_path):
    plan = make_plan(tmp_path, "z2", "--dp-shard", "2", "--zero", "2", gpus=2)
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
         "from executor.resilience import lock; held = lock.acquire(Path(sys.argv[2])); print('locked', flush=True); "
         "time.sleep(120)", str(REPO), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        res = cli("execute", str(plan), "--steps", "2", "--out", str(out))
        assert res.code == 2, res.stderr
        assert f"is in use by another run (pid {holder.pid} on host" in res.stderr
        assert "execute: debug on" not in res.stderr  # refused before the launch line, so before any rank
        assert not (out / "metrics.jsonl").exists() and time.monotonic() - started < 60
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def test_resume_that_changes_the_run_is_refused_before_any_rank(cli, tmp_path):
    plan = make_plan(tmp_path, "z2", "--dp-shard", "2", "--zero", "2", gpus=2)
    out = tmp_path / "run"
    _write_run(out, steps=6)
    res = cli("execute", str(plan), "--steps", "10", "--out", str(out), "--resume")
    assert res.code == 2 and "step-4 was written by a run of another shape (--steps 6 -> 10)" in res.stderr
    assert "--allow-plan-change" in res.stderr and "execute: debug on" not in res.stderr
    res = cli("execute", str(plan), "--steps", "6", "--out", str(out), "--resume-from", "step-3")
    assert res.code == 2 and "no such complete checkpoint (complete: step-2, step-4)" in res.stderr
    res = cli("execute", str(plan), "--steps", "6", "--out", str(out), "--nproc-per-node", "4")
    assert res.code == 2 and "add --replan" in res.stderr
    assert not (out / "run.lock").exists()  # released


def test_checkpoint_verify_names_each_damaged_file(cli, tmp_path):
    out = tmp_path / "run"
    _write_run(out, checkpoints=(2, 4, 6))
    res = cli("checkpoint", "verify", str(out))
    assert res.code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["step-2", "ok"], ["step-4", "ok"], ["step-6", "ok"]]
    assert lines[-1].endswith("<- latest")

    shard = next((out / "checkpoints" / "step-4").glob("*.distcp"))
    os.truncate(shard, 10)
    (out / "checkpoints" / "step-6" / ".metadata").unlink()
    res = cli("checkpoint", "verify", str(out), "--json")
    assert res.code == 1
    doc = json.loads(res.stdout)
    assert doc["latest"] == "step-6" and doc["ok"] is False
    problems = {c["step"]: c["problems"] for c in doc["checkpoints"]}
    assert problems[2] == [] and problems[6] == [".metadata: missing"]
    assert len(problems[4]) == 1 and problems[4][0].startswith(f"{shard.name}: 10 bytes, ")
    assert problems[4][0].endswith("(truncated)")
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 of 3 checkpoint(s) fail verification: step-4: ") and "step-6: .metadata" in last
    one = cli("checkpoint", "verify", str(out / "checkpoints" / "step-2"))
    assert one.code == 0 and one.stdout.split()[:2] == ["step-2", "ok"]
    assert cli("checkpoint", "verify", str(tmp_path / "nope")).code == 2
    assert cli("checkpoint", "verify", str(tmp_path)).code == 2
