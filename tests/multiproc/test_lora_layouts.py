"""LoRA under FSDP, TP x DP (with and without SP) and PP x DP reproduces a single-process LoRA run (executor.lora).

The reference is plain PyTorch on one process: the executor's model with its
seeded base weights, frozen; beside every target linear two matrices A (r x
in) and B (out x r) holding the adapters' seeded initial values, added as
W x + (alpha / r) B A x by a forward hook written here; torch's AdamW over
A and B only, LambdaLR and clip_grad_norm_. Each layout is one real `meshplan
execute` of a `meshplan plan --finetune lora` plan on 4 CPU ranks (gloo), 4
steps, fp32: the loss and the adapters' gradient norm match within 1e-3
relative. A checkpointed run resumed from step 2 reproduces steps 3-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrun_util import execute, make_plan

from executor.components.data import SyntheticTokens, local_batch
from executor.components.optim import BETAS, EPS, MAX_GRAD_NORM, WEIGHT_DECAY, WarmupCosine, default_lr
from executor.lora import lora_init_value
from executor.model import build_model, init_weights
from planner.model.load import load_model

STEPS, GLOBAL_BATCH, SEQ_LEN, SEED = 4, 8, 64, 0
RANK, ALPHA = 4, 16.0
RTOL = 1e-3
LORA = ("--finetune", "lora", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA))
MODULES = {"attention.wq": "column", "attention.wk": "column", "attention.wv": "column", "attention.wo": "row",
           "feed_forward.w1": "column", "feed_forward.w3": "column", "feed_forward.w2": "row"}

LAYOUTS = {
    "fsdp4": ["--dp-shard", "4", "--zero", "3", "--micro-batch", "1"],
    "tp2_dp2": ["--tp", "2", "--dp", "2", "--no-sequence-parallel"],
    "tp2_sp_fsdp2": ["--tp", "2", "--dp-shard", "2", "--zero", "2", "--sequence-parallel"],
    "pp2_dp2": ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1", "--pp-schedule", "1f1b"],
}


def reference_run(model_name: str = "debug") -> list[dict]:
    spec = load_model(model_name)
    cpu = torch.device("cpu")
    model = build_model(spec, cpu)
    init_weights(model, spec, SEED, cpu)
    model.requires_grad_(False)
    adapters = []
    for layer, block in model.layers.items():
        for name in MODULES:
            linear = block.get_submodule(name)
            fqn = f"layers.{layer}.{name}"
            a = torch.nn.Parameter(lora_init_value(fqn + ".lora_A.weight", (RANK, linear.in_features), SEED, cpu))
            b = torch.nn.Parameter(lora_init_value(fqn + ".lora_B.weight", (linear.out_features, RANK), SEED, cpu))
            adapters += [a, b]
            linear.register_forward_hook(
                lambda _m, args, out, a=a, b=b: out + (ALPHA / RANK) * (args[0] @ a.T) @ b.T)
    opt = torch.optim.AdamW([{"params": adapters, "weight_decay": WEIGHT_DECAY}], lr=default_lr(spec.hidden),
                            betas=BETAS, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine.for_run(STEPS))
    source = SyntheticTokens(spec.vocab, SEQ_LEN, SEED)
    records = []
    for step in range(STEPS):
        x, y = local_batch(source, step * GLOBAL_BATCH, GLOBAL_BATCH, 1, 0, cpu)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(adapters, MAX_GRAD_NORM)
        records.append({"loss": loss.item(), "grad_norm": norm.item()})
        opt.step()
        opt.zero_grad()
        sched.step()
    return records


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return reference_run()


def test_reference_adapters_learn(reference):
    """The adapters train (B starts at zero, so step 1 is the base model's loss) and the test can fail."""
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.01
    assert all(r["grad_norm"] > 0 for r in reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_single_process(layout, reference, tmp_path):
    plan = make_plan(tmp_path, layout, *LAYOUTS[layout], *LORA)
    records = execute(plan, tmp_path / "run", "--seed", str(SEED), steps=STEPS)
    for got, want in zip(records, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), (layout, got["step"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), (layout, got["step"])


def test_lora_checkpoint_resumes(reference, tmp_path):
    """A TP x DP LoRA run checkpointed at steps 2 and 4, rolled back to step 2 and resumed, repeats steps 3-4."""
    import shutil

    plan = make_plan(tmp_path, "resume", *LAYOUTS["tp2_dp2"], *LORA)
    out = tmp_path / "run"
    execute(plan, out, "--seed", str(SEED), "--checkpoint-every", "2", "--keep-checkpoints", "2", steps=STEPS)
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4"]
    shutil.rmtree(root / "step-4")
    (root / "latest").write_text("step-2\n")
    records = execute(plan, out, "--seed", str(SEED), "--resume", steps=STEPS)
    steps = [r["step"] for r in records]
    assert steps[-2:] == [3, 4] and steps.count(1) == 1, steps  # resumed at step 3, not started again
    resumed = {r["step"]: r for r in records}
    for step in (3, 4):
        assert resumed[step]["loss"] == pytest.approx(reference[step - 1]["loss"], rel=RTOL), step
