"""Checkpoint integrity in one process: checksums written with every file, verified on load, the fallback.

The reference for "the right checkpoint loaded" is the same toy model trained
without interruption in this process (test_checkpoint.py's helpers), compared
tensor by tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
from test_checkpoint import app, toy, train

from executor.components.checkpoint import CheckpointManager, consolidate
from executor.components.optim import WarmupCosine
from executor.resilience.integrity import MANIFEST, verify_run, verify_step
from topologies.errors import NonFiniteError, UsageError


def _three_checkpoints(tmp_path) -> CheckpointManager:
    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path, run_info={"model": "toy", "steps": 6})
    train(model, optim, state, 6, mgr, every=2)
    return mgr


def _trained(steps: int):
    model, optim, state = toy()
    train(model, optim, state, steps)
    return model


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_manifest_covers_every_file_and_verifies(tmp_path):
    _three_checkpoints(tmp_path)
    step = tmp_path / "checkpoints" / "step-6"
    listed = set(json.loads((step / MANIFEST).read_text())["files"])
    assert listed == {p.name for p in step.iterdir()} - {MANIFEST}  # .metadata, run.json, every .distcp
    assert json.loads((step / "run.json").read_text()) == {"model": "toy", "steps": 6, "step": 6}
    verdict = verify_step(step)
    assert verdict.ok and not verdict.unverified and verdict.files == len(listed)


def test_random_bytes_and_truncation_fall_back_to_the_newest_valid(tmp_path, capsys):
    mgr = _three_checkpoints(tmp_path)
    root = tmp_path / "checkpoints"
    shard = next((root / "step-6").glob("*.distcp"))
    with open(shard, "r+b") as f:  # 4 KiB of random bytes inside the data: no error from DCP or torch.load
        f.seek(min(1000, shard.stat().st_size - 4096))
        f.write(os.urandom(4096))
    os.truncate(next((root / "step-4").glob("*.distcp")), 100)

    model, optim, state = toy(seed=3)
    assert mgr.load(app(model, optim, state)) == 2 and state.step == 2
    assert _same(model, _trained(2))
    err = capsys.readouterr().err
    assert f"step-6 fails verification ({shard.name}: contents changed" in err and "falling back to step-4" in err
    assert "step-4 fails verification" in err and "(truncated)" in err and "falling back to step-2" in err
    assert (root / "latest").read_text().strip() == "step-2"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4.damaged", "step-6.damaged"]
    rows = verify_run(root)
    assert [(r["step"], r.get("set_aside", False)) for r in rows] == [(2, False), (4, True), (6, True)]


def test_missing_file_and_damaged_manifest_are_named(tmp_path):
    _three_checkpoints(tmp_path)
    root = tmp_path / "checkpoints"
    missing = next((root / "step-6").glob("*.distcp"))
    missing.unlink()
    assert verify_step(root / "step-6").problems == [f"{missing.name}: missing"]
    manifest = root / "step-4" / MANIFEST
    text = manifest.read_text()
    at = text.index('"sha256": "') + len('"sha256": "')  # the first file's digest: flip one hex digit of it
    manifest.write_text(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:])
    assert verify_step(root / "step-4").problems == [f"{MANIFEST}: its own checksum does not match (the manifest "
                                                      "is damaged)"]
    with pytest.raises(UsageError, match="--resume-from step-6: .* fails verification: .*missing"):
        CheckpointManager(tmp_path).load(app(*toy()), step=6)
    assert (root / "step-6").is_dir()  # asked for by name: refused, not set aside


def test_shares_split_the_files_among_ranks(tmp_path):
    _three_checkpoints(tmp_path)
    step = tmp_path / "checkpoints" / "step-2"
    shares = [verify_step(step, rank, 3) for rank in range(3)]
    assert sum(v.files for v in shares) == verify_step(step).files
    assert sum(v.bytes for v in shares) == verify_step(step).bytes


def test_checkpoint_without_checksums_loads_unverified(tmp_path, capsys):
    mgr = _three_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "step-6" / MANIFEST).unlink()
    model, optim, state = toy(seed=3)
    assert mgr.load(app(model, optim, state)) == 6
    assert _same(model, _trained(6))
    assert "no checksums" in capsys.readouterr().err


def test_resume_from_an_older_step_moves_latest_and_keeps_the_newer_until_rewritten(tmp_path):
    mgr = _three_checkpoints(tmp_path)
    root = tmp_path / "checkpoints"
    model, optim, state = toy(seed=3)
    assert mgr.load(app(model, optim, state), step=2) == 2 and _same(model, _trained(2))
    assert (root / "latest").read_text().strip() == "step-2"
    assert CheckpointManager(tmp_path).load(app(*toy())) == 2  # a restart now resumes the same continuation
    train(model, optim, state, 4, mgr, every=2)  # step-4 of this continuation replaces the abandoned one
    assert (root / "latest").read_text().strip() == "step-4"
    assert consolidate(root / "step-4")["0.weight"].equal(model.state_dict()["0.weight"])
    with pytest.raises(UsageError, match="no complete checkpoint .*step-5"):
        mgr.load(app(*toy()), step=5)


def test_non_finite_state_is_never_saved(tmp_path):
    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path)
    train(model, optim, state, 2, mgr, every=2)
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"not saving checkpoint step-3: .*model\.2\.bias"):
        mgr.save(3, app(model, optim, state))
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-2" and not (root / "step-3").exists()


@dataclass(frozen=True)
class _OldWarmupCosine:
    """The LR factor as checkpoints before WarmupCosine's rescheduling fields stored it."""

    total_steps: int
    warmup_steps: int
    min_ratio: float = 0.1

    def __call__(self, k: int) -> float:
        return WarmupCosine(self.total_steps, self.warmup_steps, self.min_ratio)(k)


def test_checkpoint_from_before_the_rescheduling_fields_loads(tmp_path):
    from executor.train import TrainState

    model, optim, _ = toy()
    old = TrainState([torch.optim.lr_scheduler.LambdaLR(optim, _OldWarmupCosine(10, 1))])
    for _ in range(3):
        optim.step()
        old.schedulers[0].step()
    old.step = 3
    CheckpointManager(tmp_path).save(3, {"model": model, "optim": optim, "train": old})

    model, optim, _ = toy(seed=4)
    new = TrainState([torch.optim.lr_scheduler.LambdaLR(optim, WarmupCosine.for_run(99))])
    assert CheckpointManager(tmp_path).load({"model": model, "optim": optim, "train": new}) == 3
    assert new.schedulers[0].lr_lambdas[0] == WarmupCosine(10, 1)  # the checkpoint's schedule, defaults kept
    assert new.schedulers[0].last_epoch == 3
