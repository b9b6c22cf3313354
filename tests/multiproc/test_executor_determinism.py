"""The executor's determinism contract: every layout trains the single-process model.

Same seed -> same initial weights (drawn per parameter FQN, then sharded) and
the same global batch at every step (split by data-parallel rank). So the
loss, and the gradient norm before clipping, at every step must match a
single-process run within 1e-3 relative in fp32 on CPU, for every layout.

The reference is written here in plain PyTorch on one process - the full
model, one forward over the whole global batch, torch's AdamW, LambdaLR and
torch.nn.utils.clip_grad_norm_ - so it shares only the model, the data and
the hyper-parameters with the executor, not its training loop. Each layout
is one real `meshplan execute` of a plan made by `meshplan plan` with pinned
flags: 4 CPU ranks under torchrun on gloo, 4 steps (clipping is active from
step 3 on, so the norm matters).

Masked data (a chat corpus whose loss counts only the assistant turns) runs a
few layouts too: there the reference's loss is torch's cross_entropy mean over
the counted targets of the whole global batch, and the counted targets fall
unevenly on micro-batches, dp ranks and cp shards, so only a layout that scales
by the global count matches it (test_masked_batches_are_uneven shows a
per-shard mean would not).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from text_corpus import chat_records, make_tokenizer, write_jsonl
from torchrun_util import DETERMINISM_LAYOUTS, execute, make_plan

from executor.components.data import IGNORE_INDEX, SyntheticTokens, local_batch, open_source
from executor.components.optim import BETAS, EPS, MAX_GRAD_NORM, WEIGHT_DECAY, WarmupCosine, default_lr
from executor.model import build_model, init_weights
from planner.model.load import load_model
from planner.plan import load_plan

STEPS, GLOBAL_BATCH, SEQ_LEN, SEED = 4, 8, 64, 0
RTOL = 1e-3
METRIC_KEYS = {"step", "loss", "lr", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"}  # ARCHITECTURE.md

# Beyond the eight shared layouts (torchrun_util): per-op SAC, context, expert and the lifted
# refusals (ZeRO-1 on DTensors, zb-v with replicas, tied embeddings across stages).
LAYOUTS = {
    **DETERMINISM_LAYOUTS,
    # per-op SAC with FSDP2, two micro-batches: gradients reduce-scattered per micro-batch
    "fsdp4_op": ("debug", ["--dp-shard", "4", "--zero", "3", "--recompute", "op", "--micro-batch", "1"]),
    # HSDP, two micro-batches: shards all-reduced across replicas after the last one only
    "hsdp_2x2_accum": ("debug", ["--dp", "4", "--dp-shard", "2", "--zero", "3", "--micro-batch", "1"]),
    # context parallel: K/V all-gathered over cp, load-balanced chunks; cp folded into FSDP / DDP
    "cp2_dp2": ("debug", ["--cp", "2", "--dp-shard", "2", "--zero", "3", "--micro-batch", "1"]),
    "cp2_tp2": ("debug", ["--cp", "2", "--tp", "2", "--recompute", "op"]),
    # FSDP over the cp ranks alone (dp 1): torchtitan's dp_shard_cp with dp_shard 1
    "cp2_tp2_fsdp_cp": ("debug", ["--cp", "2", "--tp", "2", "--dp", "1", "--zero", "3"]),
    # ZeRO-1 on DTensor parameters (executor/components/zero1.py)
    "zero1_tp2_dp2": ("debug", ["--tp", "2", "--dp", "2", "--zero", "1"]),
    # zb-v's split weight pass with replicas (FSDP2 units reduce after the schedule)
    "zbv_pp2_dp2": ("debug", ["--pp", "2", "--dp-shard", "2", "--zero", "2", "--micro-batch", "1",
                              "--pp-schedule", "zb-v"]),
    # tied embeddings across stages: the first and last stage's gradients summed
    "gpt_pp2_dp2_tied": ("debug-gpt", ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1",
                                       "--pp-schedule", "1f1b"]),
    # MoE: experts sharded over ep, tokens moved with all_to_all, experts as FSDP2 / replicate units
    "moe_dp4_ep2": ("debug-moe", ["--dp", "4", "--dp-shard", "2", "--ep", "2", "--zero", "3"]),
    "moe_fsdp4_ep4": ("debug-moe", ["--dp-shard", "4", "--ep", "4", "--zero", "3", "--micro-batch", "1"]),
    # the experts' FSDP2 units reduce-scatter over 2 ranks (edp = dp_shard / ep) dividing by dp x cp
    "moe_fsdp4_ep2": ("debug-moe", ["--dp-shard", "4", "--ep", "2", "--zero", "3"]),
    "moe_tp2_dp2_ep2": ("debug-moe", ["--tp", "2", "--dp", "2", "--ep", "2"]),
}


# Layouts for the masked chat corpus: FSDP with two micro-batches per rank, TP (vocabulary-parallel loss),
# PP with four micro-batches (the schedule's loss function), CP (each rank holds two chunks of every sequence).
MASKED_LAYOUTS = {
    "fsdp4": ("debug", ["--dp-shard", "4", "--zero", "3", "--micro-batch", "1"]),
    "tp2_dp2": ("debug", ["--tp", "2", "--dp", "2"]),
    "pp2_dp2": ("debug", ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1", "--pp-schedule", "1f1b"]),
    "cp2_dp2": ("debug", ["--cp", "2", "--dp-shard", "2", "--zero", "3", "--micro-batch", "1"]),
}


def reference_run(model_name: str, data: str | None = None, tokenizer=None) -> list[dict]:
    """Single-process training in plain PyTorch (see the module docstring)."""
    spec = load_model(model_name)
    cpu = torch.device("cpu")
    model = build_model(spec, cpu)
    init_weights(model, spec, SEED, cpu)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=default_lr(spec.hidden), betas=BETAS, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine.for_run(STEPS))
    source = (SyntheticTokens(spec.vocab, SEQ_LEN, SEED) if data is None
              else open_source(data, spec.vocab, SEQ_LEN, SEED, tokenizer=tokenizer))
    records = []
    for step in range(STEPS):
        x, y = local_batch(source, step * GLOBAL_BATCH, GLOBAL_BATCH, 1, 0, cpu)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        records.append({"loss": loss.item(), "grad_norm": norm.item(), "lr": sched.get_last_lr()[0]})
        opt.step()
        opt.zero_grad()
        sched.step()
    return records


@pytest.fixture(scope="module")
def references() -> dict[str, list[dict]]:
    return {name: reference_run(name) for name in ("debug", "debug-gpt", "debug-moe")}


def test_reference_learns(references):
    """The reference itself trains: the synthetic Markov data is learnable and clipping is exercised."""
    for name, records in references.items():
        assert records[-1]["loss"] < records[0]["loss"] - 0.2, name
        assert any(r["grad_norm"] > MAX_GRAD_NORM for r in records), f"{name}: clipping never active"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    model, pinned = LAYOUTS[layout]
    plan = make_plan(tmp_path, layout, *pinned, model=model)
    out = tmp_path / "run"
    records = execute(plan, out, "--seed", str(SEED), steps=STEPS)
    ref = references[model]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, ref, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), (layout, got["step"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), (layout, got["step"])
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)
    check_run_dir(out, plan, records)


def check_run_dir(out, plan, records) -> None:
    """The run directory's contract: metric keys, the plan's copy, measured next to predicted."""
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert load_plan(out / "plan.json").to_json() == load_plan(plan).to_json()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measured"]["loss_last"] == records[-1]["loss"]
    assert summary["measured"]["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in records)
    assert summary["predicted"]["step_time_s"] == load_plan(plan).prediction.step_time_s
    assert summary["measured_over_predicted"]["tokens_per_s"] == pytest.approx(
        summary["measured"]["tokens_per_s"] / summary["predicted"]["tokens_per_s"])


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    """(data, tokenizer) of a small chat corpus and its tiny BPE tokenizer (tests/text_corpus.py)."""
    where = tmp_path_factory.mktemp("chat")
    tok = make_tokenizer(where / "tok")
    return write_jsonl(where / "chat.jsonl", chat_records(200)), tok


@pytest.fixture(scope="module")
def masked_reference(chat_corpus) -> list[dict]:
    data, tok = chat_corpus
    return reference_run("debug", str(data), tok)


def test_masked_batches_are_uneven(chat_corpus):
    """The test below can fail: the first batch's gradient under per-shard means is far from the global mean's."""
    data, tok = chat_corpus
    spec = load_model("debug")
    model = build_model(spec, torch.device("cpu"))
    init_weights(model, spec, SEED, torch.device("cpu"))
    source = open_source(str(data), spec.vocab, SEQ_LEN, SEED, tokenizer=tok)
    x, y = local_batch(source, 0, GLOBAL_BATCH, 1, 0, torch.device("cpu"))
    counted = (y != IGNORE_INDEX).view(4, -1).sum(1)
    assert len(set(counted.tolist())) > 1, counted

    def gradient(shard_means: bool) -> torch.Tensor:
        model.zero_grad()
        losses = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(4, -1)
        loss = (losses.sum(1) / counted).mean() if shard_means else losses.sum() / counted.sum()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact, per_shard = gradient(False), gradient(True)
    assert (per_shard - exact).norm() / exact.norm() > 10 * RTOL


@pytest.mark.parametrize("layout", list(MASKED_LAYOUTS))
def test_masked_chat_matches_single_process(layout, chat_corpus, masked_reference, tmp_path):
    model, pinned = MASKED_LAYOUTS[layout]
    data, tok = chat_corpus
    plan = make_plan(tmp_path, layout, *pinned, model=model)
    records = execute(plan, tmp_path / "run", "--seed", str(SEED), "--data", str(data), "--tokenizer", str(tok),
                      steps=STEPS)
    for got, want in zip(records, masked_reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), (layout, got["step"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), (layout, got["step"])
