"""Runs that write or read Hugging Face models and expert-parallel checkpoints, on 4 CPU ranks (torchrun, gloo).

tests/consumers/test_hf_models.py compares these paths with transformers; here, without it:
  * an expert-parallel checkpoint holds every ep rank's experts (E, ...) and resumes under another ep degree
    with the reference run's losses;
  * a random-init run's `--save-hf-every` directory reads back into meshplan's model with the logits of the
    same step's DCP checkpoint, its config.json written from the ModelSpec;
  * `--init-from` a directory of another model, or `--save-hf-every` for a model no Hugging Face family
    computes, is refused before any rank starts, naming the fields (exit 2).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import run_cli
from torchrun_util import execute, make_plan

from executor.components.checkpoint import consolidate
from executor.hf.files import WeightsDir
from executor.hf.load import load_part
from executor.model import build_model, init_weights
from planner.model.load import load_model

CPU = torch.device("cpu")


def losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


def test_expert_parallel_checkpoint_resumes_under_another_ep(tmp_path):
    ep2 = make_plan(tmp_path, "ep2", "--dp-shard", "4", "--ep", "2", "--zero", "3", model="debug-moe")
    ep4 = make_plan(tmp_path, "ep4", "--dp-shard", "4", "--ep", "4", "--zero", "3", model="debug-moe")
    reference = tmp_path / "reference"
    execute(ep2, reference, "--checkpoint-every", "2", steps=4)
    w1 = consolidate(reference / "checkpoints" / "step-2")["layers.0.feed_forward.w1"]
    assert w1.shape == (4, 64, 64)  # all four experts, not one ep rank's two
    assert not torch.equal(w1[:2], w1[2:])
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    (out / "checkpoints" / "latest").write_text("step-2\n")
    execute(ep4, out, "--resume", steps=4)
    got, want = losses(out), losses(reference)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """debug (random init) under TP 2 x DP 2, 2 steps, a checkpoint and a Hugging Face model at step 2."""
    tmp = tmp_path_factory.mktemp("hf_run")
    plan = make_plan(tmp, "tp", "--tp", "2", "--dp", "2")
    out = tmp / "run"
    execute(plan, out, "--checkpoint-every", "2", "--save-hf-every", "2", steps=2)
    return plan, out


def test_random_init_run_saves_a_hugging_face_model(hf_run):
    _, out = hf_run
    saved = out / "hf" / "step-2"
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((saved / "config.json").read_text())
    assert (config["model_type"], config["dtype"]) == ("llama", "float32")
    spec = load_model(str(saved))
    loaded = build_model(spec)
    load_part(loaded, spec, WeightsDir(saved), CPU)
    restored = build_model(spec)
    init_weights(restored, spec, 1, CPU)
    restored.load_state_dict(consolidate(out / "checkpoints" / "step-2"))
    x = torch.randint(0, spec.vocab, (2, 32))
    assert torch.equal(loaded(x), restored(x))


def test_checkpoint_export_writes_the_same_model(hf_run, tmp_path):
    _, out = hf_run
    r = run_cli("checkpoint", "export", str(out), "--to", str(tmp_path / "hf"), "--format", "hf")
    assert r.code == 0, r.stderr
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "hf" / name).read_bytes() == (out / "hf" / "step-2" / name).read_bytes(), name
    again = run_cli("checkpoint", "export", str(out), "--to", str(tmp_path / "hf"), "--format", "hf")
    assert again.code == 2 and "already exists and is not an empty directory" in again.stderr
    r = run_cli("checkpoint", "export", str(out), "--to", str(tmp_path / "m.pt"), "--dtype", "bf16")
    assert r.code == 2 and "--dtype applies to --format hf" in r.stderr


def test_mismatched_weights_and_unexportable_models_are_refused_before_launch(hf_run, tmp_path):
    plan, out = hf_run
    saved = tmp_path / "saved"
    shutil.copytree(out / "hf" / "step-2", saved)
    config = json.loads((saved / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    (saved / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    r = run_cli("execute", str(plan), "--init-from", str(saved), "--steps", "1", "--out", str(tmp_path / "x"))
    assert r.code == 2, r.stderr
    assert "rope_theta: plan 10000.0, " in r.stderr and "norm_eps: plan 1e-05, " in r.stderr, r.stderr
    assert "family" not in r.stderr  # a preset's model exported as llama is the same model
    assert not (tmp_path / "x").exists()  # refused before the run directory or any rank
    moe = make_plan(tmp_path, "moe", "--dp-shard", "4", "--zero", "3", model="debug-moe")
    r = run_cli("execute", str(moe), "--save-hf-every", "1", "--steps", "1", "--out", str(tmp_path / "y"))
    assert r.code == 2 and "no Hugging Face family computes it" in r.stderr, r.stderr
