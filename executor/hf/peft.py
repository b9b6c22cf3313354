"""LoRA adapters out of a DCP checkpoint: PEFT's directory (`checkpoint export --format peft`), or merged into
the base weights (`checkpoint export --format hf --merge-lora`).

PEFT's directory is what `PeftModel.save_pretrained` writes for a LoRA
adapter and `PeftModel.from_pretrained(base, DIR)` reads: adapter_config.json
(peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules by the
base's module names, no dropout, no bias) and adapter_model.safetensors with
PEFT's keys, `base_model.model.<the base weight's Hugging Face name less
.weight>.lora_A.weight` (r x in) and `.lora_B.weight` (out x r), the adapter
name ("default") left out as PEFT leaves it out on save. Our adapters sit
beside linears whose Hugging Face weight is the same tensor (executor.hf.adapter's
`Same` rule: Llama, Qwen, Mistral families); a family whose projections are
fused or transposed (GPT-2's c_attn) has no PEFT module per target, and is
refused with that reason.

Merging (executor.lora.merge_adapters, called by executor.hf.export.write_shards):
W' = W + (alpha / r) B A for every adapted weight, in fp32, before the family's
transform and the output dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

from executor.hf.adapter import Same, export_rules
from executor.lora import ADAPTER_SUFFIXES, adapter_bases
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec
from topologies.errors import UsageError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_names(spec: ModelSpec, bases: list[str]) -> dict[str, str]:
    """Our base weight FQN -> its Hugging Face weight name, for every adapted base (module docstring)."""
    rules = {rule.ours[0]: rule for rule in export_rules(spec) if len(rule.ours) == 1}
    out = {}
    for base in bases:
        rule = rules.get(base)
        if not isinstance(rule, Same):
            raise UsageError(f"--format peft: {base!r} of a {spec.family or 'llama'} model is not one Hugging Face "
                             "linear of its own (fused or transposed there), so PEFT has no module to put its "
                             "adapter on; export --format hf --merge-lora instead")
        out[base] = rule.theirs[0]
    return out


def adapter_config(training: TrainingSpec, target_modules: list[str], base_path: str | None) -> dict:
    """PEFT's LoraConfig fields for these adapters (module docstring)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": training.lora_rank,
            "lora_alpha": training.lora_alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted(target_modules), "base_model_name_or_path": base_path,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "revision": None}


def export_peft(step_dir: Path, to: Path, spec: ModelSpec, training: TrainingSpec, base_path: str | None,
                dtype: str | None) -> dict:
    """Write PEFT's adapter directory into `to` (beside it first, renamed into place when complete)."""
    from safetensors.torch import save_file

    from executor.components.checkpoint import consolidate
    from executor.hf.export import TORCH_DTYPES, check_destination, checkpoint_shapes, staged_directory

    check_destination(to)
    if not training.lora:
        raise UsageError("--format peft exports LoRA adapters; this run trained every parameter (finetune full): "
                         "export --format hf")
    shapes, _ = checkpoint_shapes(step_dir)
    bases = adapter_bases(shapes)
    if not bases:
        raise UsageError(f"checkpoint {str(step_dir)!r} holds no LoRA adapters (no *.lora_A.weight tensors)")
    names = peft_names(spec, bases)
    keys = [b[: -len(".weight")] + s for b in bases for s in ADAPTER_SUFFIXES]
    ours = consolidate(step_dir, keys=keys)
    out_dtype = TORCH_DTYPES[dtype or "fp32"]
    tensors = {}
    for base, theirs in names.items():
        stem = theirs[: -len(".weight")]
        for suffix in ADAPTER_SUFFIXES:
            tensors[PEFT_PREFIX + stem + suffix] = ours[base[: -len(".weight")] + suffix].to(out_dtype).contiguous()
    modules = sorted({theirs[: -len(".weight")].rsplit(".", 1)[-1] for theirs in names.values()})
    with staged_directory(to) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(training, modules, base_path)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"tensors": len(tensors), "target_modules": modules, "dtype": dtype or "fp32"}
