"""A Hugging Face model directory from a DCP checkpoint, shard by shard: `checkpoint export --format hf`,
`execute --save-hf-every K`.

The output is what save_pretrained writes: config.json (the --init-from
directory's, recorded in the run as RUN/hf_source/, or one written from the
ModelSpec: executor.hf.config), the weights in the family's names and layout
(executor.hf.adapter) as model.safetensors or model-0000K-of-0000N.safetensors
with model.safetensors.index.json, and the tokenizer and generation files
the source directory had.

Memory: the tensors are grouped into shard files of at most `max_shard_bytes`
(a tensor larger than that gets a file of its own, as save_pretrained does),
planned from the checkpoint's metadata alone; each shard's tensors are read
from the checkpoint with one DCP load of just those keys, converted, written
and dropped before the next. A process holds one shard at a time, never the
whole model. During a run every rank writes the shards i with i % world ==
rank, so the conversion is spread over the job.

dtype: the source weights' dtype when the run started from a Hugging Face
directory, else the checkpoint's (fp32 master weights); `dtype` overrides it.
torch's own HuggingFaceStorageWriter (torch.distributed.checkpoint) writes a
state dict under its own keys; the per-family transforms here (one tensor per
expert, GPT-2's fused and transposed projections) need the full tensors, so
the conversion goes through consolidated shards instead.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.hf.adapter import Rule, export_rules
from executor.hf.config import DTYPE_NAMES, config_json, with_dtype
from executor.hf.files import CONFIG, TOKENIZER_FILES, shard_names, write_index, write_shard
from planner.model.spec import ModelSpec
from topologies.errors import UsageError

SHARD_BYTES = 5 * 10**9  # 5 GB files: what the hubs' large models mostly hold
SOURCE = "hf_source"  # RUN/hf_source/: config.json, tokenizer files and source.json of the --init-from directory
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ExportPlan:
    """Which rules (our tensors -> theirs) go into which shard file, and the output's dtype."""

    spec: ModelSpec
    shards: tuple[tuple[Rule, ...], ...]
    shapes: dict  # our FQN -> full shape (from the checkpoint's metadata)
    dtype: str
    lora_scale: float = 0.0  # LoRA adapters merged into their base weights with this alpha / r (executor.lora)

    @property
    def names(self) -> list[str]:
        return shard_names(len(self.shards))


def checkpoint_shapes(step_dir: Path) -> tuple[dict[str, tuple[int, ...]], torch.dtype]:
    """Our FQN -> full shape of every model tensor in a DCP checkpoint, and their (widest) dtype."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from executor.components.checkpoint import SafeReader

    metadata = SafeReader(step_dir).read_metadata()
    shapes, dtypes = {}, set()
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            shapes[key[len("model."):]] = tuple(md.size)
            dtypes.add(md.properties.dtype)
    if not shapes:
        raise UsageError(f"checkpoint {str(step_dir)!r} holds no model tensors")
    return shapes, max(dtypes, key=lambda d: torch.empty((), dtype=d).element_size())


def plan_export(spec: ModelSpec, step_dir: Path, dtype: str | None, source: Path | None,
                max_shard_bytes: int = SHARD_BYTES, lora_scale: float | None = None) -> ExportPlan:
    """Group the family's tensors into shard files of at most max_shard_bytes, in the checkpoint's order.

    lora_scale: merge the checkpoint's LoRA adapters into their base weights (alpha / r); a checkpoint with
    adapters and no scale is refused, so an export never drops what the run trained."""
    from executor.lora import adapter_bases

    shapes, stored = checkpoint_shapes(step_dir)
    if adapter_bases(shapes) and lora_scale is None:
        raise UsageError(f"checkpoint {str(step_dir)!r} holds LoRA adapters: export them with --format peft, or "
                         "fold them into the weights with --format hf --merge-lora")
    if dtype is None:
        dtype = _source_dtype(source) or {v: k for k, v in TORCH_DTYPES.items()}.get(stored, "fp32")
    itemsize = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    shards: list[list[Rule]] = [[]]
    size = 0
    for rule in export_rules(spec):
        missing = [name for name in rule.ours if name not in shapes]
        if missing:
            raise UsageError(f"checkpoint {str(step_dir)!r} has no {missing[0]!r}: it was written for another "
                             f"model than {spec.name!r} (its plan.json)")
        nbytes = sum(math.prod(shapes[name]) for name in rule.ours) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(rule)
        size += nbytes
    return ExportPlan(spec, tuple(tuple(s) for s in shards), shapes, dtype, lora_scale or 0.0)


def _source_dtype(source: Path | None) -> str | None:
    try:
        return json.loads((source / "source.json").read_text())["dtype"] if source else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_shards(plan: ExportPlan, step_dir: Path, out: Path, rank: int = 0, world: int = 1) -> dict[str, str]:
    """Write this rank's shard files (i % world == rank) into `out`; returns HF key -> file for them."""
    from executor.components.checkpoint import consolidate

    weight_map = {}
    for i, (rules, name) in enumerate(zip(plan.shards, plan.names, strict=True)):
        if i % world != rank:
            continue
        keys = [n for rule in rules for n in rule.ours]
        ours = consolidate(step_dir, keys=keys)
        if plan.lora_scale:
            from executor.lora import ADAPTER_SUFFIXES, merge_adapters

            lora = [k[: -len(".weight")] + s for k in keys for s in ADAPTER_SUFFIXES
                    if k.endswith(".weight") and k[: -len(".weight")] + s in plan.shapes]
            if lora:
                merge_adapters(ours, consolidate(step_dir, keys=lora), plan.lora_scale)
        tensors = {}
        for rule in rules:
            for key, value in rule.save(ours).items():
                tensors[key] = value.to(TORCH_DTYPES[plan.dtype])
        del ours
        write_shard(out / name, tensors)
        weight_map.update({key: name for key in tensors})
    return weight_map


def finish(plan: ExportPlan, out: Path, source: Path | None) -> None:
    """config.json, the index (several shards) and the source's tokenizer and generation files."""
    if source is not None and (source / CONFIG).is_file():
        config = with_dtype(json.loads((source / CONFIG).read_text()), plan.dtype)
    else:
        config = config_json(plan.spec, plan.dtype)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if len(plan.shards) > 1:
        itemsize = torch.empty((), dtype=TORCH_DTYPES[plan.dtype]).element_size()
        weight_map, total = {}, 0
        for rules, name in zip(plan.shards, plan.names, strict=True):
            for rule in rules:
                shapes = {n: torch.empty(plan.shapes[n], device="meta") for n in rule.ours}
                for key, value in rule.save(shapes).items():
                    weight_map[key] = name
                    total += value.numel() * itemsize
        write_index(out, weight_map, total)
    for name in TOKENIZER_FILES:
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def export_checkpoint(step_dir: Path, to: Path, spec: ModelSpec, source: Path | None, dtype: str | None,
                      max_shard_bytes: int = SHARD_BYTES, lora_scale: float | None = None) -> ExportPlan:
    """One process: the whole export into `to` (written beside it, renamed into place when complete)."""
    check_destination(to)
    plan = plan_export(spec, step_dir, dtype, source, max_shard_bytes, lora_scale)
    with staged_directory(to) as tmp:
        write_shards(plan, step_dir, tmp)
        finish(plan, tmp, source)
    return plan


@contextlib.contextmanager
def staged_directory(to: Path):
    """A directory written beside `to` and renamed into place only when the block completes: a reader never
    sees half an export, and a failure leaves `to` as it was (new, or empty: check_destination)."""
    tmp = to.parent / f".tmp-{to.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if to.exists():
            to.rmdir()  # empty (check_destination)
        os.replace(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_destination(to: Path) -> None:
    """--to names a new or empty directory: an export never replaces files it was not asked to."""
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UsageError(f"--to {str(to)!r} already exists and is not an empty directory; choose a new directory "
                         "(an export never writes over files)")


def record_source(directory: Path, run_dir: Path) -> None:
    """RUN/hf_source/: the --init-from directory's config.json, tokenizer and generation files, and its dtype."""
    from executor.hf.files import WeightsDir

    target = run_dir / SOURCE
    target.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG, *TOKENIZER_FILES):
        if (directory / name).is_file():
            shutil.copyfile(directory / name, target / name)
    counts: dict[torch.dtype, int] = {}
    for info in WeightsDir(directory).tensors.values():
        counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
    stored = max(counts, key=counts.get) if counts else torch.float32
    dtype = {v: k for k, v in TORCH_DTYPES.items()}.get(stored, "fp32")
    (target / "source.json").write_text(json.dumps({"path": str(directory.resolve()), "dtype": dtype}) + "\n")


__all__ = ["DTYPE_NAMES", "SHARD_BYTES", "SOURCE", "ExportPlan", "check_destination", "export_checkpoint",
           "finish", "plan_export", "record_source", "write_shards"]
