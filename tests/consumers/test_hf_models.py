"""Hugging Face models in and out, against transformers 5.23 itself (the reference, test-only).

Tiny random models made with transformers for each family the executor builds (Llama 3 with llama3 rope
scaling and theta 500k, Mistral's sliding window, Qwen2's q/k/v biases with tied embeddings, Qwen3's q/k
norms, Mixtral, Qwen3-MoE, Qwen2-MoE's gated shared expert, DeepSeek-V3's MLA and group-limited sigmoid
router, GPT-2), their norms, biases and score biases moved off their initial constants so a missed
tensor shows, saved with save_pretrained (fp32, with a BPE tokenizer trained by the tokenizers library):

  * one process: meshplan's model loaded from the directory gives transformers' logits within 1e-5;
  * 4 CPU ranks (`meshplan plan --model DIR` then `meshplan execute`, which starts from the weights the
    plan recorded): TP 2 x DP 2, TP 2 x FSDP 2, FSDP 4, PP 2 x DP 2, CP 2 x FSDP 2, EP 2 with DP 4, spread
    over the families (LAYOUTS); each step's loss equals a plain single-process transformers model trained with
    torch.optim.AdamW on the same token batches (the executor's optimizer settings) within 1e-4;
  * the run's Hugging Face model (`--save-hf-every`, and `checkpoint export --format hf`) reloads with
    AutoModelForCausalLM.from_pretrained and gives the logits of meshplan's model restored from the run's
    DCP checkpoint within 1e-5, and carries the tokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import run_cli

from executor.components.checkpoint import consolidate
from executor.components.data import SyntheticTokens, local_batch
from executor.components.optim import BETAS, EPS, MAX_GRAD_NORM, WEIGHT_DECAY, WarmupCosine, default_lr
from executor.hf.files import WeightsDir
from executor.hf.load import load_part
from executor.model import build_model, init_weights
from planner.model.load import load_model

VOCAB, SEQ, BATCH, STEPS = 256, 64, 8, 3
CPU = torch.device("cpu")
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256)
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def configs():
    T = transformers
    return {
        "llama3": T.LlamaConfig(**BASE, rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
        "mistral": T.MistralConfig(**BASE, sliding_window=24),
        "qwen2": T.Qwen2Config(**BASE, tie_word_embeddings=True),
        "qwen3": T.Qwen3Config(**BASE, head_dim=32),
        "mixtral": T.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": T.Qwen3MoeConfig(**BASE, **MOE, norm_topk_prob=True),
        "qwen2_moe": T.Qwen2MoeConfig(**BASE, **MOE, shared_expert_intermediate_size=48),
        "deepseek_v3": T.DeepseekV3Config(
            **{**BASE, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1,
            num_nextn_predict_layers=0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "mscale": 1.0, "mscale_all_dim": 1.0}),
        "gpt2": T.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=256, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    }


def bpe_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of VOCAB tokens, trained on a few sentences (tokenizer.json + its config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the model the config describes, exactly", "weights in, a model out"] * 8, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, config) in enumerate(configs().items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:  # norms and biases away from 1 and 0
                    p.add_(torch.randn_like(p) * 0.1)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
        model.save_pretrained(root / name)
        bpe_tokenizer(root / name)
        out[name] = root / name
    return out


def hf_model(directory: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def ours_from(directory: Path):
    spec = load_model(str(directory))
    model = build_model(spec)
    load_part(model, spec, WeightsDir(directory), CPU)
    return model


@pytest.mark.parametrize("name", list(configs()))
def test_one_process_gives_transformers_logits(hf_dirs, name):
    x = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf_model(hf_dirs[name])(x).logits
        got = ours_from(hf_dirs[name])(x)
    assert (got - want).abs().max().item() < 1e-5, name


@functools.cache
def reference_run(directory: Path):
    """transformers' model trained in one process with torch.optim.AdamW as the executor configures it:
    (its loss at every step, the trained model)."""
    model = hf_model(directory).train()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=default_lr(load_model(str(directory)).hidden), betas=BETAS, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine.for_run(STEPS))
    source = SyntheticTokens(VOCAB, SEQ, 0)
    losses = []
    for step in range(STEPS):
        x, y = local_batch(source, step * BATCH, BATCH, 1, 0, CPU)
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, model.eval()


# family -> pinned layout of 4 CPU ranks
LAYOUTS = {
    "llama3": ["--tp", "2", "--dp", "2"],
    "qwen3": ["--tp", "2", "--dp-shard", "2", "--zero", "3"],  # q/k norms under TP, FSDP over TP's shards
    "qwen2": ["--dp-shard", "4", "--zero", "3"],
    "mistral": ["--cp", "2", "--dp-shard", "2", "--zero", "3", "--micro-batch", "1"],  # the window under CP
    "gpt2": ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1", "--pp-schedule", "1f1b"],
    "qwen3_moe": ["--dp-shard", "4", "--ep", "2", "--zero", "3"],
    "deepseek_v3": ["--tp", "2", "--dp-shard", "2", "--zero", "3", "--ep", "2", "--no-sequence-parallel"],
}


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, pins in LAYOUTS.items():
        plan = root / f"{name}.json"
        r = run_cli("plan", "--model", str(hf_dirs[name]), "--cluster", "cpu", "--gpus", "4", "--global-batch",
                    str(BATCH), "--seq-len", str(SEQ), "--recompute", "none", *pins, "-o", str(plan))
        assert r.code == 0, r.stderr
        run = root / name
        r = run_cli("execute", str(plan), "--steps", str(STEPS), "--out", str(run), "--log-every", "100",
                    "--checkpoint-every", str(STEPS), "--save-hf-every", str(STEPS), timeout=400)
        assert r.code == 0, f"{name}: {r.stderr[-3000:]}"
        assert f"weights: {hf_dirs[name].resolve()}" in r.stderr  # the plan's weights, without --init-from
        out[name] = run
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_as_transformers_does(runs, hf_dirs, name):
    rows = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
    want, _ = reference_run(hf_dirs[name])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, loss in zip(rows, want, strict=True):
        assert row["loss"] == pytest.approx(loss, abs=1e-4), (name, row["step"])
    assert want[-1] < want[0]  # the reference trains: the comparison is over moving weights


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_saved_model_reloads_in_transformers(runs, hf_dirs, name):
    """RUN/hf/step-N: transformers' logits equal meshplan's model restored from the same step's checkpoint,
    and (within what three AdamW steps of float reordering leave) the model transformers trained itself."""
    run = runs[name]
    exported = run / "hf" / f"step-{STEPS}"
    spec = load_model(str(exported))
    ours = build_model(spec)
    init_weights(ours, spec, 0, CPU)  # materialized, rope tables computed; every weight is then overwritten
    ours.load_state_dict(consolidate(run / "checkpoints" / f"step-{STEPS}"))
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    _, trained = reference_run(hf_dirs[name])
    with torch.no_grad():
        logits = hf_model(exported)(x).logits
        assert (logits - ours(x)).abs().max().item() < 1e-5, name
        assert (logits - trained(x).logits).abs().max().item() < 5e-4, name  # measured: at most 7.2e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer.decode(tokenizer.encode("weights in, a model out")) == "weights in, a model out"


def test_checkpoint_export_format_hf(runs, tmp_path):
    """`checkpoint export --format hf`: the same files as --save-hf-every (fp32), and --dtype bf16 with an index."""
    run = runs["qwen3_moe"]
    r = run_cli("checkpoint", "export", str(run), "--to", str(tmp_path / "fp32"), "--format", "hf", "--json")
    assert r.code == 0, r.stderr
    assert r.json()["dtype"] == "fp32"
    saved = run / "hf" / f"step-{STEPS}"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "fp32" / name).read_bytes() == (saved / name).read_bytes(), name
    r = run_cli("checkpoint", "export", str(run), "--to", str(tmp_path / "bf16"), "--format", "hf", "--dtype", "bf16",
                "--max-shard-size", "100KB")
    assert r.code == 0, r.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    x = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
        assert (bf16(x).logits - hf_model(saved)(x).logits).abs().max().item() < 0.05
    again = run_cli("checkpoint", "export", str(run), "--to", str(tmp_path / "bf16"), "--format", "hf")
    assert again.code == 2 and "already exists" in again.stderr
