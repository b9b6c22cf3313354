"""What clusters do to long runs, on real CPU ranks: a worker lost on one of two nodes, damaged checkpoints,
NaN losses, SIGTERM, a second run into the same directory, a node lost for good.

Two-node runs are two `meshplan execute` processes on this host, each a
torchrun agent with 2 ranks, meeting at a c10d rendezvous on localhost. The
losses of every resumed run are compared step by step with an uninterrupted
run (test_checkpoint_e2e's 4-rank FSDP reference, 6 steps; the same layout as
two nodes of two) or, after a re-plan to 2 ranks, with a 2-rank run resumed
from the same checkpoint by hand. Faults come from executor/faults.py's
test-only hooks, which fire only before a process resumes a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, processes_mentioning, run_cli
from test_checkpoint_e2e import COMMON, PINS, STEPS, execute, losses, make_plan, reference_run, steps_logged

from executor.faults import KILL_ENV, KILL_NODE_ENV, NAN_ENV, PAUSE_ENV, STOP_ENV
from executor.resilience.integrity import verify_step

NODE_TIMEOUT_S = 300
# torchrun's rendezvous waits 30 s for more nodes once the minimum has joined, and declares a node dead
# after 3 missed 5 s heartbeats; here 10 s (node 1 starts 3 s after node 0, within it) and 2 x 1 s (PET_* is
# how torchrun reads its flags from the environment), so a lost node costs the survivor seconds, not a minute
FAST_RDZV = {"PET_RDZV_CONF": "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2"}


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.getbasetemp() / "meshplan-ckpt")


def two_node_plan(where: Path) -> Path:
    """The reference's layout (FSDP over 4 ranks) as 2 nodes x 2 ranks."""
    path = where / "fsdp-2x2.json"
    if not path.exists():
        r = run_cli("plan", *COMMON, *PINS["fsdp"], "--set", "gpus_per_node=2", "-o", str(path))
        assert r.code == 0, r.stderr
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(plan: Path, out: Path, rank: int, port: int, *flags: str, env: dict | None = None):
    cmd = [sys.executable, str(REPO / "cli.py"), "execute", str(plan), "--steps", str(STEPS), "--out", str(out),
           "--log-every", "1", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
           *flags]
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=full)


def finish(nodes, out: Path, timeout: float = NODE_TIMEOUT_S) -> list[tuple[int, str]]:
    """(exit code, stderr) of each node process; none is left running, nor any of its workers."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for proc in nodes:
            _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, stderr))
    finally:
        cleanup(nodes, out)
    return results


def cleanup(nodes, out: Path) -> None:
    for proc in nodes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in processes_mentioning([str(out)]):
        os.kill(pid, signal.SIGKILL)


def lines(stderr: str, prefix: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def assert_losses(got: dict, want: dict, steps, rtol: float) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=rtol), f"step {step}: {got[step]} vs {want[step]}"


def test_two_nodes_one_worker_killed_the_other_node_hung(reference, tmp_path):
    """Rank 3 (node 1) is SIGKILLed and rank 0 (node 0) SIGSTOPped after step 5: both nodes restart, whatever
    their restart counts, rendezvous under one generation key and resume from step-4."""
    out, port = tmp_path / "run", free_port()
    plan = two_node_plan(tmp_path)
    faults = {KILL_ENV: "5:3", STOP_ENV: "5:0"}
    nodes = [start_node(plan, out, r, port, "--checkpoint-every", "2", "--max-restarts", "1", env=faults)
             for r in (0, 1)]
    results = finish(nodes, out)
    assert [code for code, _ in results] == [0, 0], [err[-3000:] for _, err in results]
    restarts = [lines(err, "execute: restart") for _, err in results]
    assert sorted(len(r) for r in restarts) == [1, 1], restarts
    said = " ".join(r[0] for r in restarts)
    assert "rank 3 (this node's local rank 1) was killed by SIGKILL" in said and "they resume from step-4" in said
    assert steps_logged(out) == [1, 2, 3, 4, 5, 5, 6]  # step 5 ran again after the restart
    assert_losses(losses(out), losses(reference), range(1, STEPS + 1), rtol=1e-5)


def test_damaged_checkpoint_is_named_and_the_run_falls_back(reference, tmp_path):
    """4 KiB of random bytes inside a file of the reference's step-6: --resume names the file, sets the
    checkpoint aside, resumes step-4 with the uninterrupted run's losses, and `latest` ends on a checkpoint
    that verifies. (Truncated and missing files: tests/unit/test_checkpoint_integrity.py.)"""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    root = out / "checkpoints"
    flipped = root / "step-6" / "__1_0.distcp"
    with open(flipped, "r+b") as f:
        f.seek(flipped.stat().st_size // 2)
        f.write(os.urandom(4096))
    r = execute(make_plan("fsdp", tmp_path), out, "--checkpoint-every", "2", "--keep-checkpoints", "2", "--resume")
    assert r.code == 0, r.stderr
    said = lines(r.stderr, "checkpoint:")
    assert said[0].startswith("checkpoint: step-6 fails verification (__1_0.distcp: contents changed since it was "
                              "written") and said[0].endswith("set aside as step-6.damaged; falling back to step-4")
    assert said[1] == f"checkpoint: resumed from {root / 'step-4'}"
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6, 5, 6]
    assert_losses(losses(out), losses(reference), range(1, STEPS + 1), rtol=1e-5)
    assert (root / "latest").read_text().strip() == "step-6" and verify_step(root / "step-6").ok
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-4", "step-6", "step-6.damaged"]


def test_nan_losses_are_skipped_then_three_in_a_row_stop_with_exit_4(tmp_path):
    """NaN at step 3 (skipped, counted, training goes on) and at 5, 6, 7 (the run stops): exit 4, no checkpoint
    after step 4, and step-4's state is finite and verifies."""
    import torch

    from executor.components.checkpoint import consolidate

    plan = tmp_path / "z2.json"
    r = run_cli("plan", *COMMON[:5], "2", *COMMON[6:], "--dp-shard", "2", "--zero", "2", "-o", str(plan))
    assert r.code == 0, r.stderr
    out = tmp_path / "run"
    r = run_cli("execute", str(plan), "--steps", "8", "--out", str(out), "--log-every", "1", "--checkpoint-every",
                "2", env={NAN_ENV: "3,5,6,7"}, timeout=NODE_TIMEOUT_S)
    assert r.code == 4, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank") and "exit code 4" in last and "steps 5, 6, 7:" in last, last
    assert len(lines(r.stderr, "step 3: loss nan")) == 1 and "update skipped (1 in a row" in r.stderr
    assert "Traceback" not in r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert [row.get("skipped_update", False) for row in rows] == [False, False, True, False, True, True]
    assert rows[2]["loss"] is None and rows[3]["loss"] is not None
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-4" and not (root / "step-6").exists()
    assert verify_step(root / "step-4").ok
    assert all(torch.isfinite(t).all() for t in consolidate(root / "step-4").values())


def test_sigterm_to_both_nodes_checkpoints_within_the_grace_then_resume_matches(reference, tmp_path):
    """Both node processes get SIGTERM while the run pauses after step 3 (async checkpoints every 2): every rank
    checkpoints step 3 and they exit 75 within --preempt-grace-s. Meanwhile a second run into the same --out is
    refused before any rank starts. `--resume` (one node, same layout) then matches the uninterrupted run."""
    out, port, grace_s = tmp_path / "run", free_port(), 30
    plan = two_node_plan(tmp_path)
    flags = ("--checkpoint-every", "2", "--async-checkpoint", "--preempt-grace-s", str(grace_s))
    nodes = [start_node(plan, out, r, port, *flags, env={PAUSE_ENV: "3:240"}) for r in (0, 1)]
    try:
        deadline = time.monotonic() + NODE_TIMEOUT_S
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and all(n.poll() is None for n in nodes):
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert len(metrics.read_text().splitlines()) == 3, "the run did not reach its pause"
        second = run_cli("execute", str(make_plan("fsdp", tmp_path)), "--steps", "6", "--out", str(out))
        assert second.code == 2 and "is in use by another run (pid" in second.stderr, second.stderr
        assert "execute: debug on" not in second.stderr  # refused before launching
        signalled = time.monotonic()
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        results = finish(nodes, out, timeout=grace_s + 60)
        elapsed = time.monotonic() - signalled
    finally:
        cleanup(nodes, out)
    assert [code for code, _ in results] == [75, 75], [err[-3000:] for _, err in results]
    assert elapsed < grace_s + 15  # the agents' own exit after the workers' adds a few seconds
    both = "".join(err for _, err in results)
    assert len(lines(both, "preempt: checkpoint step-3 written in")) == 1
    assert all(err.strip().splitlines()[-1] == f"preempted (SIGTERM) at step 3; last checkpoint step-3; continue "
               f"with --resume (--out {out})" for _, err in results)
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-3" and verify_step(root / "step-3").ok
    assert verify_step(root / "step-2").ok  # the async save before the signal was published

    r = execute(make_plan("fsdp", tmp_path), out, "--checkpoint-every", "2", "--resume")
    assert r.code == 0, r.stderr
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]
    assert_losses(losses(out), losses(reference), range(1, STEPS + 1), rtol=1e-5)


@pytest.fixture(scope="module")
def by_hand(reference, tmp_path_factory) -> tuple[Path, Path]:
    """(the 2-rank plan `meshplan plan` gives, a run of it resumed by hand from the reference's step-4)."""
    base = tmp_path_factory.mktemp("by-hand")
    plan = base / "fsdp-2.json"
    pinned = ["--zero", "3", "--micro-batch", "2"]  # the reference's pins that hold on 2 ranks (not dp 4)
    r = run_cli("plan", *COMMON[:5], "2", *COMMON[6:], *pinned, "-o", str(plan))
    assert r.code == 0, r.stderr
    out = base / "run"
    copy_checkpoint(reference, out, "step-4")
    r = execute(plan, out, "--resume")
    assert r.code == 0, r.stderr
    return plan, out


def copy_checkpoint(run: Path, out: Path, name: str) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / name, out / "checkpoints" / name)
    (out / "checkpoints" / "latest").write_text(f"{name}\n")


def test_replan_four_ranks_to_two_matches_the_plan_and_the_run_by_hand(reference, by_hand, tmp_path):
    plan2, hand = by_hand
    out = tmp_path / "run"
    copy_checkpoint(reference, out, "step-4")
    r = execute(make_plan("fsdp", tmp_path), out, "--resume", "--replan", "--nproc-per-node", "2")
    assert r.code == 0, r.stderr
    said = lines(r.stderr, "replan:") + lines(r.stderr, "  ")
    assert said[0].startswith("replan: 4 ranks planned (1 node x 4), 2 present (1 node x 2)")
    assert "was: tp1 pp1 dp4 Z3 mb2x1" in said[1] and "now: tp1 pp1 dp2 Z3 mb2x2" in said[2]
    ran, planned = json.loads((out / "plan.json").read_text()), json.loads(plan2.read_text())
    for key in ("parallel", "mesh", "training", "prediction", "cluster"):
        assert ran[key] == planned[key], key
    assert steps_logged(out) == [5, 6]
    assert_losses(losses(out), losses(hand), (5, 6), rtol=1e-6)
    assert_losses(losses(out), losses(reference), (5, 6), rtol=1e-3)  # another layout: summation order


def test_lost_node_replans_and_continues_without_a_person(by_hand, tmp_path):
    """Two nodes with --replan --max-restarts 1; node 1 (agent and workers) dies after step 4: node 0's agent
    re-rendezvous alone, its workers re-plan for 2 ranks and resume step-4 resharded, as by hand."""
    _, hand = by_hand
    out, port = tmp_path / "run", free_port()
    plan = two_node_plan(tmp_path)
    flags = ("--checkpoint-every", "2", "--max-restarts", "1", "--replan")
    first = start_node(plan, out, 0, port, *flags, env=FAST_RDZV)  # hosts the rendezvous store: started first
    time.sleep(3)
    lost = start_node(plan, out, 1, port, *flags, env={**FAST_RDZV, KILL_NODE_ENV: "4"})
    (code, stderr), (lost_code, _) = finish([first, lost], out)
    assert code == 0 and lost_code == -signal.SIGKILL, stderr[-3000:]
    assert len(lines(stderr, "execute: restart 1 of 1: rank")) == 1, stderr[-3000:]
    assert "replan: 4 ranks planned (2 nodes x 2), 2 present (1 node x 2)" in stderr
    assert f"checkpoint: resumed from {out / 'checkpoints' / 'step-4'}" in stderr
    assert json.loads((out / "plan.json").read_text())["parallel"]["dp_shard"] == 2
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]
    assert_losses(losses(out), losses(hand), (5, 6), rtol=1e-6)
