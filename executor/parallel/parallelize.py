"""The parallelize recipe: one straight line of small `apply_*` steps per model part.

Order, and why (torchtitan's recipe):
  1. split into pipeline stages (on meta: copying is free);
  2. tensor parallel per block (`apply_tp`): DTensor params on the tp mesh;
  3. activation checkpointing per block (`apply_ac`): after TP so the
     recomputed region contains the TP collectives;
  4. FSDP2 (`apply_fsdp`, ZeRO-2/3, HSDP) or FSDP2's replicate (ZeRO-0 with
     TP or PP): per block, then the part as root; last so it sees the TP DTensors
     and shards them further along the dp axes;
  5. materialize the local shards and initialize them from the seed
     (`executor.model.init_weights`): after sharding, so no rank ever holds
     more than its shard;
  6. DDP (`apply_ddp`, ZeRO-0/1 without TP or PP): needs real tensors, so after init.

ZeRO stage -> PyTorch (ARCHITECTURE.md): 0 DDP; 1 DDP + ZeroRedundancyOptimizer
(built in executor/components/optim.py); 2 fully_shard(reshard_after_forward=False);
3 fully_shard(reshard_after_forward=True); HSDP = fully_shard on the 2-D
(dp_replicate, dp_shard) mesh. Classic DDP cannot hold DTensor parameters, so
with tp > 1 ZeRO-0 uses `replicate` (DDP semantics - full replicas,
all-reduced gradients - implemented on FSDP2's machinery; the pipeline
stages know it). Pipelines use it too: classic DDP rebuilds its gradient
buckets from the first step's order, which a schedule running several
micro-batches before the synchronizing backward corrupts (a reducer assert).
ZeroRedundancyOptimizer cannot shard DTensors either, so ZeRO-1 runs only
with plain DDP (tp 1, pp 1) and is refused otherwise.

GPU precision: bf16 compute with fp32 gradient reduction (FSDP2
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); autocast for DDP,
whose fp32 parameters reduce fp32 gradients). CPU ranks compute in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from executor.model import Block, init_weights
from executor.parallel.mesh import DP_AXES, dp_flat
from executor.parallel.pipeline import check_pipeline, split_stage
from planner.engines import dp_path
from planner.plan import Plan
from topologies.errors import PlanError


@dataclass
class ParallelModel:
    """What one rank trains. `parts` keep the single-process FQNs (hand them to checkpoints).

    parts: this rank's model parts, unwrapped: [the whole model] without PP, else
        one module per local pipeline stage (in `stages` order).
    runners: what forward runs through: the DDP wrapper of each part, or the
        part itself (FSDP2, replicate and TP work in place).
    stages: global pipeline stage index of each part ([0] without PP).
    dp_kind: "none", "ddp", "replicate" or "fsdp": who syncs gradients.
    autocast_dtype: dtype for torch.autocast around forward, or None.
    """

    parts: list[nn.Module]
    runners: list[nn.Module]
    stages: list[int]
    dp_kind: str
    autocast_dtype: torch.dtype | None


def compute_dtype(plan: Plan, device: torch.device) -> torch.dtype:
    """bf16 (or fp32) on GPUs as the plan says; CPU ranks always compute in fp32.

    Gradients are always reduced in fp32 (the plan's default grad_dtype).
    """
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if plan.training.dtype == "bf16" else torch.float32


def check_supported(plan: Plan) -> None:
    """Refuse, before launching, what the executor does not implement.

    The rules live in planner.engines so the search never proposes
    a layout this function would refuse.
    """
    from planner.engines import executor_refusal

    reason = executor_refusal(plan.model, plan.layout, plan.training.dtype, plan.cluster.gpu.kind != "cpu",
                              plan.training)
    if reason:
        raise PlanError(reason)
    if plan.training.seq_len > plan.model.max_seq_len:
        raise PlanError(
            f"seq_len ({plan.training.seq_len}) exceeds the model's context ({plan.model.max_seq_len}); "
            "plan with a shorter --seq-len"
        )
    check_pipeline(plan.layout, plan.model.tie_embeddings)


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh, device: torch.device,
                seed: int = 0) -> ParallelModel:
    """Apply the plan to a meta-device `model` on this rank; return the initialized local parts."""
    dtype = compute_dtype(plan, device)
    parts, stages, dp_kind = shard(model, plan, mesh, dtype)
    offloaded = plan.layout.offload != "none" and device.type == "cuda"  # FSDP2 keeps the shards on the host
    for part in parts:
        init_weights(part, plan.model, seed, torch.device("cpu") if offloaded else device)
        if offloaded:  # buffers (the rope tables) are not offloaded: forward needs them on the GPU
            for module in part.modules():
                for name, buf in module.named_buffers(recurse=False):
                    setattr(module, name, buf.to(device))
    runners = [apply_ddp(part, mesh, device) for part in parts] if dp_kind == "ddp" else list(parts)
    autocast = dtype if dtype != torch.float32 and dp_kind in ("none", "ddp") else None
    return ParallelModel(parts=parts, runners=runners, stages=stages, dp_kind=dp_kind, autocast_dtype=autocast)


def shard(model: nn.Module, plan: Plan, mesh: DeviceMesh,
          dtype: torch.dtype) -> tuple[list[nn.Module], list[int], str]:
    """Steps 1-4 on the meta device: (this rank's parts, their stage indices, dp_kind). No memory used.

    `--dry-run` stops here; `parallelize` goes on to materialize and wrap.
    """
    check_supported(plan)
    layout = plan.layout
    stages = list(layout.stages_of(mesh.get_local_rank("pp"))) if layout.pp > 1 else [0]
    parts = [split_stage(model, layout, s) for s in stages] if layout.pp > 1 else [model]
    dp_kind = dp_path(layout)
    for part in parts:
        if layout.tp > 1:
            apply_tp(part, mesh["tp"], layout.sequence_parallel, plan.model)
        apply_ac(part, layout.recompute)
        if dp_kind == "fsdp":
            apply_fsdp(part, mesh, layout.zero_stage, dtype, offload=layout.offload != "none" and
                       mesh.device_type == "cuda")
        elif dp_kind == "replicate":
            apply_replicate(part, mesh, dtype)
    return parts, stages, dp_kind


# ---- 2. tensor parallel -----------------------------------------------------


def block_tp_plan(block: Block, sequence_parallel: bool) -> dict:
    """Megatron split of one block as a plain dict: q/k/v and w1/w3 by columns, wo and w2 by rows.

    Column-parallel q/k/v give each rank a / tp query heads and k / tp KV
    heads; row-parallel wo sums the partial outputs (all-reduce, or
    reduce-scatter along the sequence under SP). With sequence parallel the
    norms run on S / tp tokens each and the attention/MLP inputs are
    all-gathered along the sequence first.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=out),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=out),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def apply_tp(part: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, spec) -> None:
    """Tensor (and sequence) parallel on every block, the embedding and the output layer.

    The embedding is split by vocabulary rows and the output layer by
    vocabulary columns (logits all-gathered), unless they are tied: then both
    stay replicated. Under SP the first block must receive its sequence
    shard; when the embedding output is replicated (learned positions are
    added after the lookup, or tied weights) a PrepareModuleInput on the
    first block cuts it (Replicate -> Shard(1) is a local slice).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tied = spec.tie_embeddings
    replicated_embedding = tied or spec.position == "learned"
    top: dict = {}
    if part.tok_embeddings is not None and not tied:
        emb_out = Shard(1) if sequence_parallel and not replicated_embedding else Replicate()
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=emb_out)
    if part.output is not None:
        seq_in = Shard(1) if sequence_parallel else Replicate()
        if sequence_parallel:
            top["norm"] = SequenceParallel()
        if not tied:
            top["output"] = ColwiseParallel(input_layouts=seq_in, output_layouts=Replicate())
        elif sequence_parallel:
            top["output"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True)
    if top:
        parallelize_module(part, tp_mesh, top)
    for block in part.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(block, sequence_parallel))
    if sequence_parallel and part.tok_embeddings is not None and replicated_embedding and len(part.layers):
        first = next(iter(part.layers.values()))
        parallelize_module(first, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None),
            use_local_output=True))


# ---- 3. activation checkpointing --------------------------------------------


def apply_ac(part: nn.Module, recompute: str) -> None:
    """none | selective (the attention core, Korthikanti et al. 2022) | full (the whole block)."""
    for block in part.layers.values():
        block.full_recompute = recompute == "full"
        block.attention.selective_recompute = recompute == "selective"


# ---- 4. FSDP2 / replicate ---------------------------------------------------


def _mp_policy(dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D dp_shard mesh (FSDP), or 2-D (dp_replicate, dp_shard) when replicas exist (HSDP)."""
    if mesh["dp_replicate"].size() > 1:
        return mesh[DP_AXES]
    return mesh["dp_shard"]


def apply_fsdp(part: nn.Module, mesh: DeviceMesh, zero_stage: int, dtype: torch.dtype,
               offload: bool = False) -> None:
    """fully_shard each block, then the part as root (embeddings, final norm, output).

    ZeRO-3 frees the gathered parameters after forward and gathers them again
    in backward; ZeRO-2 keeps them until backward (more memory, one
    all-gather less); both reduce-scatter gradients.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs = dict(mesh=fsdp_mesh(mesh), reshard_after_forward=zero_stage == 3, mp_policy=_mp_policy(dtype),
                  offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for block in part.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(part, **kwargs)


def apply_replicate(part: nn.Module, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    """DDP semantics for DTensor (TP) parameters: FSDP2's replicate over the flattened dp axis."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in part.layers.values():
        replicate(block, mesh=dp_flat(mesh), mp_policy=_mp_policy(dtype))
    replicate(part, mesh=dp_flat(mesh), mp_policy=_mp_policy(dtype))


# ---- 6. DDP -----------------------------------------------------------------


def apply_ddp(part: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Classic DDP over the flattened dp group (all-reduce of bucketed gradients)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if any(_is_dtensor(p) for p in part.parameters()):
        raise PlanError("internal: DDP got DTensor parameters; tp > 1 must use replicate")
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(part, process_group=dp_flat(mesh).get_group(), device_ids=device_ids, forward_sync_buffers=False)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
