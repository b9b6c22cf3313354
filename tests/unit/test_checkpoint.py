"""CheckpointManager in one process: round trip, atomic protocol, pruning, safety, disk errors.

The reference for every "loaded correctly" check is an independent one: the
same toy model trained without interruption in this process, compared tensor
by tensor (an interrupted-and-resumed run must end bit-identical on CPU).
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from executor.components.checkpoint import CheckpointManager, complete_steps, consolidate
from executor.faults import CRASH_ENV
from topologies.errors import ExecutionError, UsageError


class Train:
    """A TrainState stand-in: step, data position, LR schedule, RNG (Stateful)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.step = 0
        self.sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 3))

    def state_dict(self) -> dict:
        return {"step": self.step, "sched": self.sched.state_dict(), "rng": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.sched.load_state_dict(sd["sched"])
        torch.set_rng_state(sd["rng"])


def toy(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Train]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return model, optim, Train(optim)


def train(model, optim, state: Train, until: int, mgr: CheckpointManager | None = None, every: int = 0) -> list[float]:
    """Steps state.step+1 .. until; the batch comes from the global RNG, so RNG state matters."""
    losses = []
    while state.step < until:
        x = torch.randn(6, 8)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        state.sched.step()
        state.step += 1
        losses.append(loss.item())
        if mgr and every and state.step % every == 0:
            mgr.save(state.step, {"model": model, "optim": optim, "train": state})
    return losses


def app(model, optim, state) -> dict:
    return {"model": model, "optim": optim, "train": state}


def test_resume_is_bit_identical_and_pointer_moves_last(tmp_path):
    ref_model, ref_optim, ref_state = toy()
    ref_losses = train(ref_model, ref_optim, ref_state, 7)

    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path, keep=2)
    losses = train(model, optim, state, 5, mgr, every=2)  # saves 2 and 4; step 5 is lost
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-4"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4"]

    model, optim, state = toy(seed=123)  # different init: everything must come from the checkpoint
    assert mgr.load_latest(app(model, optim, state)) == 4 and state.step == 4
    losses = losses[:4] + train(model, optim, state, 7)
    assert losses == ref_losses
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert optim.param_groups[0]["lr"] == ref_optim.param_groups[0]["lr"]


def test_keep_prunes_after_pointer_and_stale_tmp_is_cleaned(tmp_path):
    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path, keep=1)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-99").mkdir()
    (root / ".tmp-step-99" / "junk").write_text("half a save")
    train(model, optim, state, 6, mgr, every=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-6"]
    assert complete_steps(root) == [6] and mgr.latest_step() == 6


def test_saving_a_step_again_replaces_it(tmp_path):
    """After a restart from step 2 with no newer checkpoint, step 2 may be saved again (or step 4 redone)."""
    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path)
    train(model, optim, state, 2, mgr, every=2)
    train(model, optim, state, 3)
    mgr.save(2, app(model, optim, state))  # different weights under the same step number
    root = tmp_path / "checkpoints"
    assert mgr.latest_step() == 2 and (root / ".tmp-old-step-2").is_dir()
    assert consolidate(root / "step-2")["0.weight"].equal(model.state_dict()["0.weight"])
    mgr.save(4, app(model, optim, state))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4"]


def test_no_checkpoint_loads_nothing(tmp_path):
    model, optim, state = toy()
    before = [p.clone() for p in model.parameters()]
    assert CheckpointManager(tmp_path).load_latest(app(model, optim, state)) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optim.state, "a fresh run must not get an initialised optimizer state"


def test_stale_pointer_falls_back_to_newest_complete(tmp_path):
    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path)
    train(model, optim, state, 4, mgr, every=2)
    (tmp_path / "checkpoints" / "latest").write_text("step-8\n")  # names a checkpoint that never completed
    (tmp_path / "checkpoints" / "step-8").mkdir()  # no .metadata: incomplete
    assert mgr.latest_step() == 4


def test_crash_between_save_and_rename_keeps_previous(tmp_path, monkeypatch):
    """The test hook kills the process after dcp.save(step 4) and before the rename."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
        "from test_checkpoint import toy, train; from executor.components.checkpoint import CheckpointManager\n"
        "m, o, s = toy(); train(m, o, s, 6, CheckpointManager(sys.argv[3]), every=2)\n"
    )
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, CRASH_ENV: "4:0"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    proc = subprocess.run([sys.executable, "-c", code, str(repo), str(repo / "tests" / "unit"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-2"
    assert (root / ".tmp-step-4" / ".metadata").is_file() and not (root / "step-4").exists()

    ref_model, ref_optim, ref_state = toy()
    train(ref_model, ref_optim, ref_state, 2)
    model, optim, state = toy(seed=5)
    mgr = CheckpointManager(tmp_path)
    assert mgr.load_latest(app(model, optim, state)) == 2
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters(), strict=True))
    train(model, optim, state, 4, mgr, every=2)  # the next save cleans the interrupted one
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4"]


def test_pipeline_parts_load_into_the_whole_model(tmp_path):
    """A rank holding several stage modules (each keeps the full model's FQNs) saves them as one model."""
    whole, whole_optim, whole_state = toy()
    train(whole, whole_optim, whole_state, 3)

    parts = []
    for keep in (("0", "1"), ("2",)):
        part, _, _ = toy()
        for name in ("0", "1", "2"):
            if name not in keep:
                setattr(part, name, nn.Identity())
        parts.append(part)
    optims = [torch.optim.AdamW(p.parameters(), lr=0.05, weight_decay=0.1) for p in parts]
    state, other = Train(optims[0]), Train(optims[1])  # the same schedule on both stages
    torch.manual_seed(0)
    toy()  # consume the same RNG draws as the reference's init
    for _ in range(3):
        x = torch.randn(6, 8)
        parts[1](parts[0](x)).square().mean().backward()
        for o, s in zip(optims, (state, other), strict=True):
            o.step()
            o.zero_grad()
            s.sched.step()
        state.step += 1
    CheckpointManager(tmp_path).save(3, {"model": parts, "optim": optims, "train": state})

    model, optim, fresh = toy(seed=9)
    CheckpointManager(tmp_path).load_latest(app(model, optim, fresh))
    for (name, a), b in zip(whole.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    for a, b in zip(whole.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(whole_optim.state[a]["exp_avg_sq"], optim.state[b]["exp_avg_sq"])


def test_consolidate_gives_the_single_process_state_dict(tmp_path):
    model, optim, state = toy()
    train(model, optim, state, 2, CheckpointManager(tmp_path), every=2)
    full = consolidate(tmp_path / "checkpoints" / "step-2")
    expected = model.state_dict()
    assert full.keys() == expected.keys()
    assert all(torch.equal(full[k], expected[k]) for k in expected)


class _Payload:
    """Unpickling this would run code: it must never happen on load."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    """Refused twice over: its checksum fails, and without checksums (an older checkpoint) the allow-list."""
    model, optim, state = toy()
    train(model, optim, state, 2, CheckpointManager(tmp_path), every=2)
    marker = tmp_path / "pwned"
    step = tmp_path / "checkpoints" / "step-2"
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(UsageError, match=r"fails verification \(step-2: \.metadata: .* written"):
        CheckpointManager(tmp_path).load_latest(app(*toy()))
    step = tmp_path / "checkpoints" / "step-2.damaged"  # set aside by the failed verification
    (step / "checksums.json").unlink()
    step.rename(tmp_path / "checkpoints" / "step-2")
    with pytest.raises(UsageError, match="refusing posix.mkdir"):
        CheckpointManager(tmp_path).load_latest(app(*toy()))
    with pytest.raises(UsageError, match="refusing"):
        consolidate(tmp_path / "checkpoints" / "step-2")
    assert not marker.exists()


def test_value_that_would_run_code_is_refused(tmp_path):
    """A non-tensor value is read with torch.load(weights_only=True), which refuses arbitrary classes."""
    model, optim, _ = toy()
    marker = tmp_path / "pwned"

    class Evil(Train):
        def state_dict(self) -> dict:
            return {**super().state_dict(), "extra": _Payload(str(marker))}

    state = Evil(optim)
    train(model, optim, state, 2, CheckpointManager(tmp_path), every=2)
    model, optim, _ = toy()
    with pytest.raises(UsageError, match="cannot resume"):
        CheckpointManager(tmp_path).load_latest({"model": model, "optim": optim, "train": Evil(optim)})
    assert not marker.exists()


def test_checkpoint_of_another_model_is_a_usage_error(tmp_path):
    model, optim, state = toy()
    train(model, optim, state, 2, CheckpointManager(tmp_path), every=2)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(UsageError, match="cannot resume") as info:
        CheckpointManager(tmp_path).load_latest({"model": other})
    assert "\n" not in str(info.value) and "0.weight" in str(info.value)


def test_truncated_data_file_is_a_usage_error(tmp_path):
    model, optim, state = toy()
    train(model, optim, state, 2, CheckpointManager(tmp_path), every=2)
    for shard in (tmp_path / "checkpoints" / "step-2").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UsageError, match="truncated or damaged"):
        consolidate(tmp_path / "checkpoints" / "step-2")
    with pytest.raises(UsageError, match="cannot resume"):
        CheckpointManager(tmp_path).load_latest(app(*toy()))


def test_full_disk_during_save_is_one_line_and_keeps_previous(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path)
    train(model, optim, state, 2, mgr, every=2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(ExecutionError) as info:
        train(model, optim, state, 4, mgr, every=2)
    message = str(info.value)
    assert "step-4" in message and "No space left on device" in message and "\n" not in message
    assert mgr.latest_step() == 2 and not (tmp_path / "checkpoints" / "step-4").exists()


def test_unwritable_out_is_a_usage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UsageError, match="cannot create the checkpoint directory"):
        CheckpointManager(blocker / "run")
    with pytest.raises(UsageError, match="keep-checkpoints"):
        CheckpointManager(tmp_path, keep=0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_out_is_a_usage_error(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="pass a writable --out"):
            CheckpointManager(out)
    finally:
        out.chmod(0o700)


def test_app_state_shape_is_checked(tmp_path):
    model, optim, state = toy()
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ExecutionError, match="one per part"):
        mgr.save(1, {"model": [model, model], "optim": [optim]})
    with pytest.raises(ExecutionError, match="needs 'model'"):
        mgr.save(1, {"optim": optim})
