"""The parallelize recipe: one straight line of small `apply_*` steps per model part.

Order, and why (torchtitan's recipe):
  0. fp8 plans: float8 linear layers (executor.components.float8), before any
     parallelism so TP and FSDP see Float8Linear;
  1. split into pipeline stages (on meta: copying is free);
  2. tensor parallel per block (`apply_tp`): DTensor params on the tp mesh;
  3. activation checkpointing per block (`apply_ac`): after TP so the
     recomputed region contains the TP collectives;
  4. FSDP2 (`apply_fsdp`, ZeRO-2/3, HSDP) or FSDP2's replicate (ZeRO-0 with
     TP or PP): per block, then the part as root; last so it sees the TP DTensors
     and shards them further along the dp axes; a MoE block's routed experts
     are a unit of their own on the experts' data-parallel mesh (`moe_units`,
     executor.parallel.expert), so FSDP2 makes their compute-dtype copies;
  5. materialize the local shards and initialize them from the seed
     (`executor.model.init_weights`), or read them from a Hugging Face
     directory (`executor.hf.load.load_part`, --init-from): after sharding, so
     no rank ever holds more than its shard (and one tensor being read);
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
whose fp32 parameters reduce fp32 gradients). CPU ranks compute in fp32. The
data-parallel path and the autocast rule are the planner's
(planner.engines: the meshplan engine's `dp_path` and `autocast`), which
its memory model prices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from executor.model import Block, init_weights
from executor.moe import MoE
from executor.parallel.context import ContextShard
from executor.parallel.expert import ExpertParallel, moe_units
from executor.parallel.mesh import grad_flat, shard_mesh
from executor.parallel.pipeline import check_pipeline, split_stage
from executor.parallel.recompute import apply_ac
from planner.engines import get_engine
from planner.plan import Plan
from topologies.errors import PlanError

EXECUTOR = get_engine("meshplan")  # the rules this executor follows, as the planner prices them
# QLoRA is planned (planner.memory.lora prices its NF4 base) but not run: see executor.lora's docstring
QLORA_REFUSAL = (
    "finetune qlora: the executor does not run a 4-bit NF4 base; torchao's NF4Tensor shards under FSDP2 "
    "(torchtune's QLoRA recipes) but is not wired into meshplan's loading, TP plans and checkpoints. Plan "
    "--finetune lora (a compute-dtype base) to execute, or run the QLoRA plan's layout with torchtune")


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
    loss_parallel: bool = False  # logits stay vocabulary-sharded DTensors into the loss (TP)
    cp: ContextShard | None = None  # context parallel: inputs and targets are cut to this rank's chunks
    experts: ExpertParallel | None = None  # MoE: reduces the expert weights' gradients itself
    expert_params: list = field(default_factory=list)
    float8_all_gather: bool = False  # fp8 under FSDP2: float8 weight scales precomputed after each step


def compute_dtype(plan: Plan, device: torch.device) -> torch.dtype:
    """bf16, fp16 (with loss scaling: executor.components.optim.build_scaler) or fp32 on GPUs as the plan
    says; CPU ranks always compute in fp32.

    Gradients are always reduced in fp32 (the plan's default grad_dtype).
    """
    if device.type == "cpu":
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.training.dtype, torch.float32)


def check_supported(plan: Plan) -> None:
    """Refuse, before launching, what the executor does not implement.

    The rules live in planner.engines so the search never proposes
    a layout this function would refuse.
    """
    reason = EXECUTOR.refusal(plan.model, plan.layout, plan.training.dtype, plan.cluster.gpu.kind != "cpu",
                              plan.training) or EXECUTOR.microbatch_refusal(plan.layout)
    if reason:
        raise PlanError(reason)
    if plan.training.finetune == "qlora":
        raise PlanError(QLORA_REFUSAL)
    if plan.training.fp8:  # torchao is no dependency: say what to install before any rank starts
        from executor.components.float8 import require_torchao

        require_torchao()
    if plan.training.seq_len > plan.model.max_seq_len:
        raise PlanError(
            f"seq_len ({plan.training.seq_len}) exceeds the model's context ({plan.model.max_seq_len}); "
            "plan with a shorter --seq-len"
        )
    check_pipeline(plan.layout, plan.model.tie_embeddings)


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh, device: torch.device,
                seed: int = 0, compile: bool = False, init_from: str | None = None) -> ParallelModel:
    """Apply the plan to a meta-device `model` on this rank; return the initialized (or loaded) local parts."""
    dtype = compute_dtype(plan, device)
    parts, stages, dp_kind, experts = shard(model, plan, mesh, dtype, compile)
    offloaded = plan.layout.offload != "none" and device.type == "cuda"  # FSDP2 keeps the shards on the host
    weights = None
    if init_from is not None:
        from executor.hf.files import WeightsDir

        weights = WeightsDir(init_from)
    for part in parts:
        where = torch.device("cpu") if offloaded else device
        if weights is not None:
            from executor.hf.load import load_part

            load_part(part, plan.model, weights, where)
        else:
            init_weights(part, plan.model, seed, where)
        if plan.training.lora:
            from executor.lora import init_adapters

            init_adapters(part, seed, where)
        if offloaded:  # buffers (the rope tables) are not offloaded: forward needs them on the GPU
            for module in part.modules():
                for name, buf in module.named_buffers(recurse=False):
                    setattr(module, name, buf.to(device))
    expert_params = experts.expert_params(parts) if experts is not None else []
    runners = [apply_ddp(part, mesh, device, expert_params) for part in parts] if dp_kind == "ddp" else list(parts)
    autocast = dtype if EXECUTOR.autocast(plan.layout, dtype.itemsize, plan.training.lora) else None
    return ParallelModel(parts=parts, runners=runners, stages=stages, dp_kind=dp_kind, autocast_dtype=autocast,
                         loss_parallel=uses_loss_parallel(plan), cp=getattr(parts[0], "cp", None),
                         experts=experts, expert_params=expert_params,
                         float8_all_gather=plan.training.fp8 and dp_kind == "fsdp")


def uses_loss_parallel(plan: Plan) -> bool:
    """Vocabulary-parallel cross-entropy: under TP with an untied output layer (a tied one stays replicated)."""
    return plan.layout.tp > 1 and not plan.model.tie_embeddings


def shard(model: nn.Module, plan: Plan, mesh: DeviceMesh, dtype: torch.dtype,
          compile: bool = False) -> tuple[list[nn.Module], list[int], str, ExpertParallel | None]:
    """Steps 1-4 on the meta device: (this rank's parts, their stage indices, dp_kind, expert parallel).

    No memory used.

    `--dry-run` stops here; `parallelize` goes on to materialize and wrap.
    """
    check_supported(plan)
    layout = plan.layout
    stages = list(layout.stages_of(mesh.get_local_rank("pp"))) if layout.pp > 1 else [0]
    parts = [split_stage(model, layout, s) for s in stages] if layout.pp > 1 else [model]
    dp_kind = EXECUTOR.dp_path(layout)
    experts = ExpertParallel(mesh, layout) if plan.model.moe is not None else None
    for part in parts:
        if plan.training.fp8:  # torchtitan converts before any parallelism (executor.components.float8)
            from executor.components.float8 import convert

            convert(part, fsdp_float8_all_gather=dp_kind == "fsdp")
        if layout.tp > 1:
            apply_tp(part, mesh["tp"], layout.sequence_parallel, plan.model)
        if layout.cp > 1:
            apply_cp(part, mesh)
        if experts is not None:
            experts.shard(part)
        if plan.training.lora:  # adapters beside the target linears, the base (experts too) frozen: executor.lora
            from executor.lora import add_adapters, cast_frozen

            add_adapters(part, plan.model, plan.training, mesh["tp"] if layout.tp > 1 else None,
                         layout.sequence_parallel)
            cast_frozen(part, dtype)
        apply_ac(part, layout.recompute)
        if compile:
            apply_compile(part)
        if dp_kind == "fsdp":
            apply_fsdp(part, mesh, layout.zero_stage, dtype, offload=layout.offload != "none", experts=experts)
        elif dp_kind == "replicate":
            apply_replicate(part, mesh, dtype, experts=experts)
    return parts, stages, dp_kind, experts


# ---- 2. tensor parallel -----------------------------------------------------


def block_tp_plan(block: Block, sequence_parallel: bool) -> dict:
    """Megatron split of one block as a plain dict: q/k/v and w1/w3 by columns, wo and w2 by rows.

    Column-parallel q/k/v give each rank a / tp query heads and k / tp KV
    heads (their biases split alike); row-parallel wo sums the partial
    outputs (all-reduce, or reduce-scatter along the sequence under SP). With
    sequence parallel the norms run on S / tp tokens each and the
    attention/MLP inputs are all-gathered along the sequence first.

    Qwen3's q/k norms act on this rank's heads: SequenceParallel over the head
    dimension (torchtitan's Qwen3 plan) keeps their weights replicated
    DTensors, so each rank's partial weight gradient is all-reduced. MLA
    (torchtitan's DeepSeek-V3 plan): the up-projections wq (or wq_b) and wkv_b
    by columns, wo by rows; the down-projections and their norms stay whole on
    every rank, their gradients equal there because the column-parallel
    up-projections all-reduce their input gradients; the shared rotary key's
    partial gradient is all-reduced by the attention itself (`tp_mesh`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sequence_parallel else Replicate()
    attention = block.attention
    if hasattr(attention, "wkv_b"):  # MLA
        up = ["attention.wkv_b", "attention.wq" if attention.wq is not None else "attention.wq_b"]
        plan: dict = {name: ColwiseParallel() for name in up}
    else:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel()}
        if attention.q_norm is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["attention.wo"] = RowwiseParallel(output_layouts=out)
    if not hasattr(block.feed_forward, "router"):  # a MoE MLP stays replicated over tp (experts: ep)
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=out)
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
    if not sequence_parallel:  # torchtitan's plan: each module's input becomes one Replicate DTensor, so the
        # column-parallel linears' partial input gradients add up before one all-reduce per module (not one per
        # linear: q, k, v and w1, w3 would each all-reduce theirs). MLA's whole down-projections take plain inputs.
        if not hasattr(attention, "wkv_b"):
            plan["attention"] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                                   desired_input_layouts=(Replicate(), None, None))
        if not hasattr(block.feed_forward, "router"):
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                      desired_input_layouts=(Replicate(),))
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
        if not tied:  # loss parallel: logits stay split by vocabulary into the cross-entropy
            top["output"] = ColwiseParallel(input_layouts=seq_in, output_layouts=Shard(-1), use_local_output=False)
        elif sequence_parallel:
            top["output"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True)
    if top:
        parallelize_module(part, tp_mesh, top)
    for block in part.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(block, sequence_parallel))
        if hasattr(block.attention, "tp_mesh"):  # MLA's shared rotary key (executor.attention)
            block.attention.tp_mesh = tp_mesh
    if sequence_parallel and part.tok_embeddings is None:  # a later pipeline stage receives sequence shards
        part.seq_shards = tp_mesh.size()
    if sequence_parallel and part.tok_embeddings is not None and replicated_embedding and len(part.layers):
        first = next(iter(part.layers.values()))
        parallelize_module(first, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None),
            use_local_output=True))


# ---- 2b. context parallel --------------------------------------------------


def apply_cp(part: nn.Module, mesh: DeviceMesh) -> None:
    """Give the model and every attention the cp group (executor.parallel.context)."""
    cp_mesh = mesh["cp"]
    shard = ContextShard(group=cp_mesh.get_group(), rank=cp_mesh.get_local_rank(), size=cp_mesh.size())
    part.cp = shard
    for block in part.layers.values():
        block.attention.cp = shard


# ---- 3b. torch.compile --------------------------------------------------------


def check_compile(plan: Plan) -> None:
    """Refuse --compile where inductor cannot build kernels: CPU ranks need a C++ compiler."""
    import shutil

    if plan.cluster.gpu.kind == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise PlanError("--compile on CPU ranks needs a C++ compiler for inductor's kernels (g++, c++ or "
                        "clang++ on PATH); install one or run without --compile")


def apply_compile(part: nn.Module) -> None:
    """torch.compile each block in place (FQNs unchanged), after recomputation and before FSDP (torchtitan).

    Not fullgraph: under expert parallelism the all-to-all's split sizes are host values (a graph break).
    """
    for block in part.layers.values():
        block.compile()


# ---- 4. FSDP2 / replicate ---------------------------------------------------


def _mp_policy(dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D shard mesh (FSDP), or 2-D (dp_replicate, shard) when replicas exist (HSDP).

    The shard axis is dp_shard, with cp folded in under context parallelism
    (torchtitan's dp_shard_cp): cp ranks hold the same weights and their
    gradients are averaged like data-parallel ones.
    """
    return shard_mesh(mesh)


def offload_policy(offload: bool, device_type: str):
    """FSDP2's CPUOffloadPolicy for Layout.offload "optimizer+params": sharded parameters, their gradients and
    the optimizer step on the host, each unit's shard copied to the device before its all-gather. Pinned
    host memory on CUDA (asynchronous copies); on CPU ranks unpinned (pinning needs an accelerator), where
    the policy's code paths (gradients moved to the host shard, the step over host shards) still run."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload else OffloadPolicy()


def apply_fsdp(part: nn.Module, mesh: DeviceMesh, zero_stage: int, dtype: torch.dtype,
               offload: bool = False, experts: ExpertParallel | None = None) -> None:
    """fully_shard the embeddings, each block, final norm + output, then the part as root (torchtitan's units).

    ZeRO-3 frees the gathered parameters after forward and gathers them again
    in backward; ZeRO-2 keeps them until backward (more memory, one
    all-gather less); both reduce-scatter gradients. The embeddings and the
    head are their own units so that only one of them is gathered at a time;
    the head is not resharded after forward (its backward comes right
    after). A tied embedding/output weight cannot sit in two units: then both
    stay with the root. A MoE block has two more units (`moe_units`).
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = dict(mesh=fsdp_mesh(mesh), reshard_after_forward=zero_stage == 3, mp_policy=_mp_policy(dtype),
                  offload_policy=offload_policy(offload, mesh.device_type))
    tied = getattr(part, "spec", None) is not None and part.spec.tie_embeddings
    if not tied and part.tok_embeddings is not None:
        embeddings = [m for m in (part.tok_embeddings, part.pos_embeddings) if m is not None]
        fully_shard(embeddings if len(embeddings) > 1 else embeddings[0], **kwargs)
    blocks = list(part.layers.values())
    for i, block in enumerate(blocks):
        # torchtitan: the last block is not resharded after forward (its backward comes first)
        last = i == len(blocks) - 1
        block_kwargs = {**kwargs, "reshard_after_forward": kwargs["reshard_after_forward"] and not last}
        if experts is not None and isinstance(block.feed_forward, MoE):
            moe_units(block.feed_forward, fully_shard, experts, experts.fsdp_mesh(), block_kwargs,
                       reduce_scatters=experts.edp_shard > 1)
            experts.sharded = True
        fully_shard(block, **block_kwargs)
    if not tied and part.output is not None:
        fully_shard([part.norm, part.output], **{**kwargs, "reshard_after_forward": False})
    fully_shard(part, **kwargs)


def apply_replicate(part: nn.Module, mesh: DeviceMesh, dtype: torch.dtype,
                    experts: ExpertParallel | None = None) -> None:
    """DDP semantics for DTensor (TP) parameters: FSDP2's replicate over the flattened dp axis (MoE: `moe_units`)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    kwargs = dict(mesh=grad_flat(mesh), mp_policy=_mp_policy(dtype))
    for block in part.layers.values():
        if experts is not None and isinstance(block.feed_forward, MoE):
            moe_units(block.feed_forward, replicate, experts, experts.flat_mesh(), kwargs)
        replicate(block, **kwargs)
    replicate(part, **kwargs)


# ---- 6. DDP -----------------------------------------------------------------


def apply_ddp(part: nn.Module, mesh: DeviceMesh, device: torch.device, ignored: list | None = None) -> nn.Module:
    """Classic DDP over the flattened dp group (all-reduce of bucketed gradients)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if any(_is_dtensor(p) for p in part.parameters()):
        raise PlanError("internal: DDP got DTensor parameters; tp > 1 must use replicate")
    device_ids = [device.index] if device.type == "cuda" else None
    ids = {id(p) for p in ignored or []}
    experts = [name for name, p in part.named_parameters() if id(p) in ids]
    if experts:  # executor.parallel.expert reduces them
        DDP._set_params_and_buffers_to_ignore_for_model(part, experts)
    return DDP(part, process_group=grad_flat(mesh).get_group(), device_ids=device_ids, forward_sync_buffers=False)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
