"""Failures under `meshplan execute` on 4 CPU ranks: restart and resume, or stop cleanly with one line.

Fault injection uses the test-only hooks of executor/faults.py, read by the
workers and off unless set (first attempt only):
  * KILL_ENV="STEP:RANK": that rank SIGKILLs itself right after step STEP;
  * CRASH_ENV="STEP:RANK:raise": that rank raises a RuntimeError while saving step STEP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import processes_mentioning
from test_checkpoint_e2e import (
    STEPS,
    execute,
    launch,
    losses,
    make_plan,
    reference_run,
    steps_logged,
)

from executor.faults import CRASH_ENV, KILL_ENV


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.getbasetemp() / "meshplan-ckpt")


def test_killed_worker_restarts_and_matches_uninterrupted_run(reference, tmp_path):
    """SIGKILL rank 2 after step 5: torchrun restarts the group, which resumes from step 4 unasked."""
    out = tmp_path / "run"
    plan = make_plan("fsdp", tmp_path)
    r = execute(plan, out, "--checkpoint-every", "2", "--max-restarts", "1", env={KILL_ENV: "5:2"})
    assert r.code == 0, r.stderr
    assert "resumed from" in r.stderr and "step-4" in r.stderr
    assert steps_logged(out) == [1, 2, 3, 4, 5, 5, 6]  # step 5 ran again after the restart
    want = losses(reference)
    for step, loss in losses(out).items():
        assert loss == pytest.approx(want[step], rel=1e-5), f"step {step}"
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS}"


def test_worker_that_raises_stops_the_others(tmp_path):
    """Rank 1 raises inside a save while the others wait in a collective: the run ends, naming rank 1."""
    out = tmp_path / "raise"
    plan = make_plan("fsdp", tmp_path)
    # No hang: execute() gives up after LAUNCH_TIMEOUT_S (400 s), before the workers' own collective
    # timeout (600 s), so finishing at all proves the launcher stopped the ranks waiting for rank 1.
    r = execute(plan, out, "--checkpoint-every", "2", env={CRASH_ENV: "2:1:raise"})
    assert r.code == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1") and "RuntimeError" in last and CRASH_ENV in last, last
    assert processes_mentioning([str(out)]) == [], "workers left running"
    assert not (out / "checkpoints" / "latest").exists()  # step 2 was never published


def test_full_disk_during_save_is_one_line(tmp_path):
    """A file-size limit (RLIMIT_FSIZE) makes every checkpoint write fail, as a full disk would.

    Python ignores SIGXFSZ, so the write fails with EFBIG instead of killing the
    process; the limit is above what plan.json and metrics.jsonl need and below
    one rank's checkpoint shard.
    """
    import resource

    plan = make_plan("fsdp", tmp_path)
    out = tmp_path / "run"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    r = launch("execute", str(plan), "--steps", "2", "--checkpoint-every", "2", "--out", str(out), preexec_fn=limit)
    assert r.code == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank") and "cannot write checkpoint step-2" in last and "GiB free" in last, last
    assert "Traceback" not in r.stderr
    assert not (out / "checkpoints" / "latest").exists() and not (out / "checkpoints" / "step-2").exists()
