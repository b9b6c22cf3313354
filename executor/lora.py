"""LoRA adapters on a frozen base (Hu et al. 2021), under every layout the executor runs.

Each target linear W of a block (planner.training.LORA_TARGETS: q, k, v, o ->
attention.wq/wk/wv/wo; gate, up, down -> feed_forward.w1/w3/w2, GELU's fc1 is
"up") gets two child modules, `lora_A` (in -> r) and `lora_B` (r -> out), and
a forward hook that adds (alpha / r) * lora_B(lora_A(x)) to W's output, x
being the input W itself received. The base module and its FQNs stay as they
are, so Hugging Face loading (--init-from), TP plans and checkpoints of the
base are unchanged; the adapters' FQNs end in `.lora_A.weight` /
`.lora_B.weight` beside their base's `.weight`, as PEFT's do. MoE blocks' MLP
(routed and shared experts) and MLA projections are not adapted
(planner.memory.lora.lora_refusal).

Tensor parallel (after the base's own plan, so the hook sees the base's
prepared input and local output), split as planner.memory.lora prices it:
  column-parallel base   lora_A ColwiseParallel over r with its output
                         all-gathered (m x r), lora_B ColwiseParallel (out/t)
  row-parallel base      lora_A RowwiseParallel over in, its partial m x r
                         output reduced (all-reduce, or reduce-scatter along the
                         sequence under SP); lora_B whole on every rank
                         (replicated DTensor under SP, whose partial weight
                         gradient DTensor reduces; a plain module without SP,
                         whose gradient is the same on every TP rank)
Nothing else changes: FSDP2, replicate and DDP shard and reduce the adapters
as any parameter, activation checkpointing recomputes them with their block,
pipeline stages carry them with their blocks.

The base is frozen (requires_grad off before FSDP wraps it): no gradients, no
optimizer states (executor.components.optim takes the parameters that
require gradients). Initial values: lora_A uniform in +-1/sqrt(in) (PEFT's
kaiming-uniform with a = sqrt(5)), lora_B zero, drawn per FQN from the seed
(executor.model.full_init_value), so every layout starts from the same
adapters. With a 16-bit compute dtype the adapters run under autocast in
their hook (fp32 weights cast per op, the input kept as it is), as
planner.engines.Engine.autocast(frozen_base=True) assumes.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.memory.lora import COLUMN_TARGETS
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec

# target -> the block's module (SwiGLU: w1 gate, w3 up, w2 down; GELU: w1 fc1 "up", w2 fc2 "down")
SWIGLU_MODULES = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
                  "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
GELU_MODULES = {**SWIGLU_MODULES, "up": "feed_forward.w1"}
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(fqn: str) -> bool:
    return fqn.endswith(ADAPTER_SUFFIXES)


def target_modules(spec: ModelSpec, block: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """{target: the block's linear} for the targets this block has (MoE MLPs and a GELU's gate have none)."""
    names = SWIGLU_MODULES if spec.mlp == "swiglu" else GELU_MODULES
    moe = hasattr(block.feed_forward, "router")
    out = {}
    for target in targets:
        if target == "gate" and spec.mlp != "swiglu":
            continue
        if target in ("gate", "up", "down") and moe:
            continue
        module = block.get_submodule(names[target])
        if isinstance(module, nn.Linear):
            out[target] = module
    return out


def _adapter_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    dtype = getattr(x, "dtype", torch.float32)
    if dtype in (torch.bfloat16, torch.float16) and module.lora_A.weight.dtype != dtype:
        device_type = x.device.type
        with torch.autocast(device_type, dtype=dtype):
            delta = module.lora_B(module.lora_A(x))
    else:
        delta = module.lora_B(module.lora_A(x))
    return output + module.lora_scale * delta


def add_adapters(part: nn.Module, spec: ModelSpec, training: TrainingSpec, tp_mesh=None,
                 sequence_parallel: bool = False) -> list[str]:
    """Give every target linear of `part`'s blocks its adapters (module docstring); freeze everything else.

    Call after the base's tensor parallel plan and before FSDP/replicate. Returns the adapters' FQNs.
    """
    r, scale = training.lora_rank, training.lora_alpha / training.lora_rank
    device = next(part.parameters()).device
    for p in part.parameters():
        p.requires_grad_(False)
    names = []
    for layer, block in part.layers.items():
        for target, linear in target_modules(spec, block, training.lora_targets).items():
            n_in, n_out = _features(linear)
            with torch.device(device):
                linear.lora_A = nn.Linear(n_in, r, bias=False)
                linear.lora_B = nn.Linear(r, n_out, bias=False)
            linear.lora_scale = scale
            if tp_mesh is not None:
                _shard_adapters(linear, target in COLUMN_TARGETS, tp_mesh, sequence_parallel)
            linear.register_forward_hook(_adapter_hook)
            base = f"layers.{layer}.{_module_name(block, linear)}"
            names += [base + suffix for suffix in ADAPTER_SUFFIXES]
    return names


def _features(linear: nn.Linear) -> tuple[int, int]:
    """(in, out) features of the whole (unsharded) base."""
    from torch.distributed.tensor import DTensor

    weight = linear.weight
    shape = weight.shape if not isinstance(weight, DTensor) else weight.size()
    return int(shape[1]), int(shape[0])


def _module_name(block: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in block.named_modules() if m is module)


def _shard_adapters(linear: nn.Module, column: bool, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if column:
        parallelize_module(linear, tp_mesh, {"lora_A": ColwiseParallel(output_layouts=Replicate()),
                                             "lora_B": ColwiseParallel()})
    else:
        out = Shard(1) if sequence_parallel else Replicate()
        plan = {"lora_A": RowwiseParallel(output_layouts=out)}
        if sequence_parallel:
            plan["lora_B"] = SequenceParallel(use_local_output=True)
        parallelize_module(linear, tp_mesh, plan)


def lora_init_value(fqn: str, shape: tuple[int, ...], seed: int, device) -> torch.Tensor | None:
    """The full initial value of an adapter weight (module docstring), None for any other parameter."""
    if fqn.endswith(".lora_B.weight"):
        return torch.zeros(shape, device=device)
    if not fqn.endswith(".lora_A.weight"):
        return None
    from executor.model import param_seed

    gen = torch.Generator(device=device)
    gen.manual_seed(param_seed(seed, fqn))
    bound = 1.0 / shape[1] ** 0.5
    return (torch.rand(shape, generator=gen, device=device) * 2 - 1) * bound


@torch.no_grad()
def init_adapters(part: nn.Module, seed: int, device: torch.device) -> None:
    """Fill this rank's shard of every adapter weight from its full initial value (after the base is loaded)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for fqn, param in part.named_parameters():
        if not is_adapter(fqn):
            continue
        shape = tuple(param.size()) if isinstance(param, DTensor) else tuple(param.shape)
        full = lora_init_value(fqn, shape, seed, device)
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)


def cast_frozen(part: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen base in the compute dtype (planner.memory.lora: D bytes per parameter); on meta, before
    FSDP, so FSDP2 shards the 16-bit values."""
    if dtype == torch.float32:
        return
    cast: dict[int, nn.Parameter] = {}  # a tied weight stays one parameter
    for module in part.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=False)
                setattr(module, name, cast[id(param)])


def adapter_bases(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Base weight FQNs (`....weight`) that have adapters in a checkpoint's tensors."""
    suffix = ADAPTER_SUFFIXES[0]
    return sorted(name[: -len(suffix)] + ".weight" for name in shapes if name.endswith(suffix))


def merge_adapters(ours: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> None:
    """W += scale * B A in place of `ours`' base weights, for every base whose lora_A / lora_B are in `adapters`."""
    for name, weight in list(ours.items()):
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        a, b = (adapters.get(f"{stem}{s}") for s in ADAPTER_SUFFIXES) if stem else (None, None)
        if a is not None and b is not None:
            ours[name] = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
