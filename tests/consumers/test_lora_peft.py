"""A LoRA run's adapters in PEFT's format, read by peft 0.21 itself on the transformers base (the reference).

A tiny random Llama saved by transformers is the base; `meshplan plan --model DIR --finetune lora` on 4 CPU
ranks (TP 2 x DP 2) starts from its weights and trains adapters for 3 steps, checkpointing the last. Then:

  * `checkpoint export --format peft`: `peft.PeftModel.from_pretrained(base, DIR)` gives the logits of
    meshplan's LoRA model restored from the same checkpoint within 1e-5 (and the adapters moved: its logits
    differ from the base's);
  * `checkpoint export --format hf --merge-lora`: transformers' model from the merged directory gives them too;
  * the run's `--save-hf-every` directory holds the merged weights as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import run_cli
from test_hf_models import bpe_tokenizer

from executor.components.checkpoint import consolidate
from executor.lora import add_adapters
from executor.model import build_model, init_weights
from planner.model.load import load_model
from planner.plan import load_plan

VOCAB, SEQ, BATCH, STEPS = 256, 64, 8, 3
CPU = torch.device("cpu")
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """(the base's directory, the LoRA run's directory)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=256, rope_theta=500000.0)
    base = root / "base"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base)
    bpe_tokenizer(base)  # the run's data reader takes the base's tokenizer
    plan = root / "plan.json"
    r = run_cli("plan", "--model", str(base), "--cluster", "cpu", "--gpus", "4", "--global-batch", str(BATCH),
                "--seq-len", str(SEQ), "--tp", "2", "--dp", "2", "--finetune", "lora", "--lora-rank", str(RANK),
                "--lora-alpha", str(ALPHA), "-o", str(plan))
    assert r.code == 0, r.stderr
    out = root / "run"
    r = run_cli("execute", str(plan), "--steps", str(STEPS), "--out", str(out), "--log-every", "100",
                "--checkpoint-every", str(STEPS), "--save-hf-every", str(STEPS), timeout=400)
    assert r.code == 0, r.stderr[-3000:]
    return base, out


def ours(run_dir: Path):
    """meshplan's LoRA model (one process) with the run's last checkpoint."""
    plan = load_plan(run_dir / "plan.json")
    model = build_model(plan.model, CPU)
    init_weights(model, plan.model, 0, CPU)
    add_adapters(model, plan.model, plan.training)
    model.load_state_dict(consolidate(run_dir / "checkpoints" / f"step-{STEPS}"))
    return model.eval()


def tokens():
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))


def test_peft_loads_the_adapters_and_gives_our_logits(run, tmp_path):
    import peft

    base, out = run
    r = run_cli("checkpoint", "export", str(out), "--to", str(tmp_path / "adapter"), "--format", "peft")
    assert r.code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    x = tokens()
    with torch.no_grad():
        before = hf(x).logits
        model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        assert model.peft_config["default"].r == RANK and model.peft_config["default"].lora_alpha == ALPHA
        got = model(x).logits
        want = ours(out)(x)
    assert (got - want).abs().max().item() < 1e-5
    assert (got - before).abs().max().item() > 1e-4  # the adapters trained: the comparison is not the base's


def test_merged_export_gives_our_logits(run, tmp_path):
    base, out = run
    r = run_cli("checkpoint", "export", str(out), "--to", str(tmp_path / "plain"), "--format", "hf")
    assert r.code == 2 and "--merge-lora" in r.stderr  # never the base alone, silently
    r = run_cli("checkpoint", "export", str(out), "--to", str(tmp_path / "merged"), "--format", "hf", "--merge-lora")
    assert r.code == 0, r.stderr
    x = tokens()
    want = ours(out)(x)
    for directory in (tmp_path / "merged", out / "hf" / f"step-{STEPS}"):
        merged = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (merged(x).logits - want).abs().max().item() < 1e-5, directory
    assert load_model(str(tmp_path / "merged")).hidden == 64
