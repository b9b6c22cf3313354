"""`execute --init-from DIR`: every rank fills its own shards from a Hugging Face directory, reading only them.

After sharding (executor.parallel.parallelize: pipeline stage, TP, EP, FSDP on
the meta device) each rank holds some parameters, each a DTensor shard or a
plain tensor. For each one it reads from the safetensors files:
  - a pipeline stage: the tensors of its own layers (and the embedding or the
    output layer where it holds them), nothing of the other stages;
  - an expert-parallel rank: the experts [first, last) it holds (its FSDP2 shard of them under
    ZeRO-2/3);
  - a DTensor whose placements are plain Shard/Replicate (FSDP's Shard(0), a
    column-parallel Shard(0), a row-parallel Shard(1), both on a 2-D mesh):
    the block `compute_local_shape_and_global_offset` gives, its rows read
    from the file directly when the family's tensor is stored as ours
    (executor.hf.adapter), the whole tensor otherwise;
  - anything else (FSDP over TP's _StridedShard): the whole tensor, cut as
    `init_weights` cuts a fresh one, `distribute_tensor(..., src_data_rank=None)`.
So a rank's host memory holds its share plus, at most, one whole tensor at a
time (executor.hf.files reads without memory-mapping). Values are cast to the
parameters' dtype. The rope tables are computed as for a random start.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from executor.hf.adapter import Rule, rules_for
from executor.hf.files import WeightsDir
from planner.model.spec import ModelSpec
from topologies.errors import UsageError


def state_tensors(part: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The part's parameters and persistent buffers by FQN (the rope tables are not persistent)."""
    out = list(part.named_parameters())
    persistent = {name for name in part.state_dict(keep_vars=True)}
    out += [(name, b) for name, b in part.named_buffers() if name in persistent]
    return out


def _plain_block(tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, global offset) of a DTensor whose shard is one contiguous block, else None."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)


def local_value(rule: Rule, read, fqn: str, tensor: torch.Tensor, rows: tuple[int, int] | None,
                device: torch.device) -> torch.Tensor:
    """This rank's piece of our tensor `fqn`, read from the files (see the module docstring)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(tensor, DTensor):
        return rule.load(read, fqn, rows)
    block = _plain_block(tensor)
    if block is None:
        full = rule.load(read, fqn, rows).to(device=device, dtype=tensor.dtype)
        return distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    shape, offset = block
    if not shape or shape[0] == 0:
        return torch.empty(shape, dtype=tensor.dtype)
    first = offset[0] + (rows[0] if rows else 0)  # an expert-parallel rank's experts start at rows[0]
    piece = rule.load(read, fqn, (first, first + shape[0]))
    for dim in range(1, len(shape)):
        piece = piece.narrow(dim, offset[dim], shape[dim])
    return piece


@torch.no_grad()
def load_part(part: nn.Module, spec: ModelSpec, weights: WeightsDir, device: torch.device) -> None:
    """Materialize `part` on `device` and fill every local shard from `weights`."""
    from torch.distributed.tensor import DTensor

    from executor.model import init_rope, local_expert_rows, materialize

    materialize(part, device)
    rules = rules_for(spec, set(weights.tensors))
    rows_of = local_expert_rows(part)
    for fqn, tensor in state_tensors(part):
        rule = rules.get(fqn)
        if rule is None and fqn.endswith((".lora_A.weight", ".lora_B.weight")):
            continue  # LoRA adapters start from the seed (executor.lora.init_adapters)
        if rule is None:
            raise UsageError(f"--init-from {weights.path}: meshplan has no Hugging Face name for {fqn!r} of a "
                             f"{spec.family or 'llama'} model")
        local = local_value(rule, weights.read, fqn, tensor, rows_of.get(id(tensor)), device)
        target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if tuple(local.shape) != tuple(target.shape):
            raise UsageError(f"--init-from {weights.path}: {', '.join(rule.theirs[:2])} gives {fqn!r} the shape "
                             f"{tuple(local.shape)}, this rank's shard is {tuple(target.shape)}: the files do not "
                             "hold the model config.json describes")
        target.copy_(local)
    init_rope(part, spec, device)


def check_weights(spec: ModelSpec, path: str | Path) -> WeightsDir:
    """Before any rank starts: every tensor the model needs is in the files, with the shape it needs.

    The expected shapes are what the adapter would write for the model (its `save` on meta tensors).
    """
    from executor.model import build_model

    weights = WeightsDir(path)
    rules = rules_for(spec, set(weights.tensors))
    model = build_model(spec)  # meta: shapes only
    ours = dict(state_tensors(model))
    if spec.tie_embeddings:
        ours.setdefault("output.weight", ours["tok_embeddings.weight"])
    problems, seen = [], set()
    for fqn in ours:
        rule = rules.get(fqn)
        if rule is None:
            problems.append(f"{fqn}: no Hugging Face name")
            continue
        if id(rule) in seen or not all(name in ours for name in rule.ours):
            continue
        seen.add(id(rule))
        for key, expected in rule.save({name: ours[name] for name in rule.ours}).items():
            if key not in weights:
                problems.append(f"{key} missing")
            elif tuple(weights.info(key).shape) != tuple(expected.shape):
                problems.append(f"{key} has shape {tuple(weights.info(key).shape)}, the model needs "
                                f"{tuple(expected.shape)}")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise UsageError(f"--init-from {path}: the safetensors files do not hold the model the plan describes: "
                         f"{shown}")
    return weights
