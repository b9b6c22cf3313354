"""Checkpoints through `meshplan execute` on 4 CPU ranks (torchrun, gloo): resume, reshard, crash, export.

The reference is one uninterrupted FSDP (ZeRO-3, dp_shard 4) run of 6 steps
of the debug model, checkpointing every 2 steps and keeping 2. Every other
run here is compared with its losses, step by step (the last entry of a step
in metrics.jsonl counts):
  * same layout, resumed after a crash: within 1e-5 relative;
  * another layout (TP 2 x DP 2; PP 2 x DP 2 -> FSDP 4): within 1e-3.
All runs use --steps 6: the LR schedule's length is part of the run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import CliResult, run_cli

from executor.faults import CRASH_ENV

STEPS = 6
LAUNCH_TIMEOUT_S = 400
PINS = {  # every search choice pinned, so the plans do not move when the planner's ranking does
    "fsdp": ["--dp", "4", "--dp-shard", "4", "--zero", "3", "--micro-batch", "2"],
    "tp": ["--tp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "4", "--no-sequence-parallel"],
    "pp": ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1", "--pp-schedule", "1f1b"],
}
COMMON = ["--model", "debug", "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64",
          "--recompute", "none"]


def make_plan(kind: str, where: Path) -> Path:
    path = where / f"{kind}.json"
    if not path.exists():
        r = run_cli("plan", *COMMON, *PINS[kind], "-o", str(path), "--json")
        assert r.code == 0, r.stderr
    return path


def launch(*args: str, env: dict | None = None, timeout: float = LAUNCH_TIMEOUT_S, preexec_fn=None) -> CliResult:
    """`cli.py ARGS` with this module's launch timeout (run_cli never leaves workers behind)."""
    return run_cli(*args, env=env, timeout=timeout, preexec_fn=preexec_fn)


def execute(plan: Path, out: Path, *flags: str, env: dict | None = None) -> CliResult:
    return launch("execute", str(plan), "--steps", str(STEPS), "--out", str(out), "--log-every", "1", *flags,
                  env=env)


def losses(out: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl; a step logged again (after a restart) keeps its last entry."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def reference_run(base: Path) -> Path:
    """The uninterrupted FSDP run, made once per session (test_failures.py reuses it)."""
    out = base / "reference"
    if not (out / "summary.json").exists():
        base.mkdir(parents=True, exist_ok=True)
        r = execute(make_plan("fsdp", base), out, "--checkpoint-every", "2", "--keep-checkpoints", "2")
        assert r.code == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def plans(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "meshplan-ckpt"


@pytest.fixture(scope="session")
def reference(plans) -> Path:
    return reference_run(plans)


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps, rtol: float) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=rtol), f"step {step}: {got[step]} vs {want[step]}"


def test_reference_keeps_two_checkpoints(reference):
    root = reference / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-4", "step-6"]
    assert (root / "latest").read_text().strip() == "step-6"
    assert steps_logged(reference) == list(range(1, STEPS + 1))


def test_crash_during_save_then_resume_matches(reference, plans, tmp_path):
    """Rank 1 is SIGKILLed between writing step 4 and the rename; `--resume` continues from step 2."""
    out = tmp_path / "run"
    r = execute(make_plan("fsdp", plans), out, "--checkpoint-every", "2", env={CRASH_ENV: "4:1"})
    assert r.code == 1, r.stderr  # which rank the launcher names first is a race: the killed one or a peer
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-2"
    assert (root / ".tmp-step-4").is_dir() and not (root / "step-4").exists()

    r = execute(make_plan("fsdp", plans), out, "--checkpoint-every", "2", "--resume")
    assert r.code == 0, r.stderr
    assert "resumed from" in r.stderr and "step-2" in r.stderr
    assert steps_logged(out) == [1, 2, 3, 4, 3, 4, 5, 6]  # appended: steps 3-4 ran again after the crash
    assert_losses_match(losses(out), losses(reference), range(1, STEPS + 1), rtol=1e-5)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4", "step-6"]  # tmp cleaned


def _resume_from(checkpoint: Path, out: Path) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
    (out / "checkpoints" / "latest").write_text(f"{checkpoint.name}\n")


def test_fsdp_checkpoint_resumes_under_tp(reference, plans, tmp_path):
    out = tmp_path / "tp"
    _resume_from(reference / "checkpoints" / "step-4", out)
    r = execute(make_plan("tp", plans), out, "--resume")
    assert r.code == 0, r.stderr
    assert steps_logged(out) == [5, 6]
    assert_losses_match(losses(out), losses(reference), (5, 6), rtol=1e-3)


def test_pp_checkpoint_resumes_under_fsdp(reference, plans, tmp_path):
    out = tmp_path / "pp"
    r = execute(make_plan("pp", plans), out, "--checkpoint-every", "4")
    assert r.code == 0, r.stderr
    assert_losses_match(losses(out), losses(reference), range(1, STEPS + 1), rtol=1e-3)
    r = execute(make_plan("fsdp", plans), out, "--resume")  # same run dir, another layout
    assert r.code == 0, r.stderr
    assert steps_logged(out)[-2:] == [5, 6]
    assert_losses_match(losses(out), losses(reference), (5, 6), rtol=1e-3)


def test_export_loads_into_the_single_process_model(reference, tmp_path):
    """The exported step-4 weights, in one process, give the loss the 4-rank run logged at step 5."""
    from executor.components.data import local_batch, open_source
    from executor.model import build_model, init_weights
    from executor.train import lm_loss
    from planner.plan import load_plan

    target = tmp_path / "model.pt"
    r = run_cli("checkpoint", "export", str(reference / "checkpoints" / "step-4"), "--to", str(target), "--json")
    assert r.code == 0, r.stderr
    summary = r.json()
    plan = load_plan(reference / "plan.json")
    model = build_model(plan.model, device="cpu")
    init_weights(model, plan.model, seed=123, device=torch.device("cpu"))  # anything: the load overwrites it
    state = torch.load(target, weights_only=True)
    assert summary["tensors"] == len(state) and summary["elements"] == plan.model.total_params  # untied model
    model.load_state_dict(state, strict=True)

    training = plan.training
    source = open_source(None, plan.model.vocab, training.seq_len, seed=0)
    inputs, targets = local_batch(source, 4 * training.global_batch_size, training.global_batch_size, 1, 0,
                                  torch.device("cpu"))
    with torch.no_grad():
        loss = lm_loss(model(inputs), targets).item()
    assert loss == pytest.approx(losses(reference)[5], rel=1e-5)

    r = run_cli("checkpoint", "export", str(reference), "--to", str(tmp_path / "latest.pt"))
    assert r.code == 0 and "step-6" in r.stdout, r.stderr
