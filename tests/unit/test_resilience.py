"""The pieces of executor.resilience that need no ranks: the run lock, the resume contract, the non-finite
guard, the LR schedule rebuilt on a plan change, and the restart line."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from executor.components.optim import WarmupCosine, reschedule
from executor.resilience import lock
from executor.resilience.contract import check_resume, run_info, write_run_info
from executor.resilience.guard import NonFiniteGuard
from topologies.errors import NonFiniteError, UsageError

REPO = Path(__file__).resolve().parents[2]


# ---- one run per directory --------------------------------------------------------------------------


def test_second_lock_is_refused_naming_the_holder(tmp_path):
    with lock.acquire(tmp_path / "run") as held:
        info = json.loads(held.path.read_text())
        assert info["pid"] == os.getpid() and info["host"]
        with pytest.raises(UsageError, match=rf"in use by another run \(pid {os.getpid()} on host "):
            lock.acquire(tmp_path / "run")  # another open file description: flock conflicts within a process too
    assert not (tmp_path / "run" / lock.LOCK_NAME).exists()
    lock.acquire(tmp_path / "run").release()  # free again


def test_lock_held_by_another_process_and_released_by_its_death(tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path\n"
            "from executor.resilience import lock\n"
            "held = lock.acquire(Path(sys.argv[2])); print('locked', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match=rf"pid {proc.pid} on host"):
            lock.acquire(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    said = []
    lock.acquire(tmp_path, log=said.append).release()  # the dead holder's file is still there: stale, taken over
    assert len(said) == 1 and "stale lock" in said[0] and f"pid {proc.pid}" in said[0]


# ---- the resume contract --------------------------------------------------------------------------------


def _plan(seq: int = 64, batch: int = 8):
    layout = SimpleNamespace(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, zero_stage=3)
    return SimpleNamespace(model=SimpleNamespace(name="debug"), layout=layout, world_size=4,
                           training=SimpleNamespace(seq_len=seq, global_batch_size=batch))


def test_resume_with_another_shape_is_refused_unless_allowed(tmp_path):
    write_run_info(tmp_path, run_info(_plan(), steps=6), step=4)
    assert check_resume(tmp_path, run_info(_plan(), steps=6), allow=False) is None
    other_layout = run_info(_plan(), steps=6) | {"world_size": 2, "layout": {"dp_shard": 2}}
    assert check_resume(tmp_path, other_layout, allow=False) is None  # a layout change needs no flag
    with pytest.raises(UsageError) as info:
        check_resume(tmp_path, run_info(_plan(seq=128), steps=10), allow=False)
    message = str(info.value)
    assert "sequence length 64 -> 128" in message and "--steps 6 -> 10" in message and "--allow-plan-change" in message
    line = check_resume(tmp_path, run_info(_plan(batch=16), steps=10), allow=True)
    assert "global batch 8 -> 16" in line and "LR schedule is rebuilt" in line


# ---- non-finite steps ----------------------------------------------------------------------------------


def test_guard_skips_counts_and_stops_at_the_limit():
    guard = NonFiniteGuard(limit=3)
    assert guard.admit(1, 5.0, 1.0) and guard.saving_allowed
    assert not guard.admit(2, math.nan, math.nan) and not guard.saving_allowed
    record = guard.annotate({"step": 2, "loss": math.nan, "grad_norm": math.inf})
    assert record["loss"] is None and record["grad_norm"] is None and record["nonfinite_in_a_row"] == 1
    assert guard.admit(3, 4.0, 1.0) and guard.saving_allowed and guard.annotate({"loss": 4.0}) == {"loss": 4.0}
    assert not guard.admit(4, 4.0, math.inf)  # a gradient norm alone counts
    assert not guard.admit(5, math.nan, 1.0)
    with pytest.raises(NonFiniteError, match="steps 4, 5, 6: .* 3 times in a row") as info:
        guard.admit(6, math.inf, 1.0)
    assert info.value.exit_code == 4 and "parameters of step 3" in str(info.value)
    assert guard.skipped == 4


def test_guard_under_loss_scaling_counts_only_the_loss():
    guard = NonFiniteGuard(limit=1, count_grad_norm=False)
    assert guard.admit(1, 5.0, math.inf)  # fp16 overflow: GradScaler skips the step itself
    with pytest.raises(NonFiniteError):
        guard.admit(2, math.nan, 1.0)


# ---- the LR schedule under --allow-plan-change ------------------------------------------------------------


@pytest.mark.parametrize("step,old,new", [(4, 6, 10), (4, 10, 6), (0, 6, 12), (1, 20, 40)])
def test_rescheduled_cosine_continues_and_ends_at_the_floor(step, old, new):
    before = WarmupCosine.for_run(old)
    after = before.rescheduled(step, new)
    assert after(step) == pytest.approx(before(step))  # no jump at the step resumed
    assert after(new - 1) == pytest.approx(before.min_ratio)  # the floor at the new last step
    factors = [after(k) for k in range(max(step, after.warmup_steps), new)]
    assert all(a >= b - 1e-12 for a, b in zip(factors, factors[1:], strict=False))  # decays monotonically


def test_reschedule_rebuilds_lambda_lr_schedulers():
    param = torch.nn.Parameter(torch.zeros(1))
    optim = torch.optim.AdamW([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, WarmupCosine.for_run(6))
    for _ in range(4):
        optim.step()
        scheduler.step()
    lr = optim.param_groups[0]["lr"]
    assert reschedule([scheduler], 4, 10) and not reschedule([scheduler], 4, 10)
    assert optim.param_groups[0]["lr"] == lr
    for _ in range(5):
        optim.step()
        scheduler.step()
    assert optim.param_groups[0]["lr"] == pytest.approx(WarmupCosine.for_run(6).min_ratio)  # step 9 of 10


# ---- the restart line -----------------------------------------------------------------------------------


def test_restart_line_names_the_failed_rank_and_the_checkpoint(tmp_path):
    from executor.resilience.agent import MeshplanAgent

    (tmp_path / "checkpoints" / "step-4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-4" / ".metadata").write_bytes(b"x")
    (tmp_path / "checkpoints" / "latest").write_text("step-4\n")
    agent = MeshplanAgent.__new__(MeshplanAgent)
    agent.run_dir, agent._remaining_restarts = tmp_path, 1
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=2), group_rank=1,
                            workers=[SimpleNamespace(global_rank=2), SimpleNamespace(global_rank=3)])
    agent._failures = {3: SimpleNamespace(exitcode=-9, local_rank=1, message="")}
    assert agent._restart_line(group) == ("execute: restart 1 of 2: rank 3 (this node's local rank 1) was killed "
                                          "by SIGKILL; restarting ranks 2-3; they resume from step-4")
    agent._failures = {2: SimpleNamespace(exitcode=1, local_rank=0, message={"message": "RuntimeError: boom\n  at x"})}
    assert "rank 2 (this node's local rank 0) exited with code 1: RuntimeError: boom at x;" in agent._restart_line(group)
    agent._failures = {}
    assert agent._restart_line(group).startswith("execute: restart: a worker on another node failed")


# ---- NCCL's flight recorder --------------------------------------------------------------------------------


def test_gpu_workers_get_the_flight_recorder_and_a_users_setting_wins(tmp_path, monkeypatch):
    from executor.launch import _worker_env

    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")
    for key in ("PYTHONPATH", "OMP_NUM_THREADS"):  # also set by _worker_env: restored after the test
        monkeypatch.setenv(key, os.environ.get(key, ""))
    _worker_env(8, on_cpu=False, run_dir=tmp_path / "run")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str((tmp_path / "run").resolve() / "comm_traces" / "rank_")
    assert (tmp_path / "run" / "comm_traces").is_dir()


def test_metrics_that_cannot_be_written_name_the_file(tmp_path, monkeypatch):
    import errno
    from pathlib import Path as _Path

    from executor.components.metrics import MetricsLog
    from topologies.errors import ExecutionError

    log = MetricsLog(tmp_path, append=False)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_Path, "open", full)
    with pytest.raises(ExecutionError) as info:
        log.write({"step": 7, "loss": 1.0})
    message = str(info.value)
    assert str(tmp_path / "metrics.jsonl") in message and "step 7" in message and "No space left" in message


def test_guard_skips_on_the_device_and_latches_at_the_limit():
    """The device half: a non-finite loss or norm skips; `limit` in a row latch the skip for every later step
    (the host stops the run at its next read, with the parameters of the step before the streak)."""
    import torch

    guard = NonFiniteGuard(limit=2)
    nan, one = torch.tensor(math.nan, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    decisions = [guard.skip(loss, norm) for loss, norm in
                 ((one, one), (nan, one), (one, one), (one, torch.tensor(math.inf)), (nan, one), (one, one))]
    assert all(d.dtype == torch.bool and d.ndim == 0 for d in decisions)
    assert [bool(d) for d in decisions] == [False, True, False, True, True, True]  # steps 4, 5: two in a row
    assert bool(NonFiniteGuard(limit=3, count_grad_norm=False).skip(one, torch.tensor(math.inf))) is False
