"""`execute --dry-run`: what a run would launch and build, printed without training.

The launch: nodes, ranks per node, the rendezvous (standalone, or c10d at
the endpoint with the run id every node derives from the plan) and the
torchrun command this node would start; the preflight's verdict on this
machine (a run here would start, or be refused with the message it would
print); how the global batch is cut into data-parallel shards and
micro-batches.

The model: rank 0 is built exactly as a run would build it, under a fake
process group (torch.testing._internal.distributed.fake_pg: FakeStore +
backend "fake"), which lets one process claim to be rank 0 of the plan's
world without any peer: init_device_mesh, parallelize_module and
fully_shard run for real on the meta device, so the printed mesh, modules
and parameter shards are those a run would build, for any model size, with
no memory and no GPU. DDP and ZeroRedundancyOptimizer need real tensors and
are described instead of built (they keep full replicas, which change no
shard).

Memory, like for like: the one figure a build on the meta device measures
is what rank 0 stores, its parameter shards (fp32 on every device: GPU runs
keep fp32 master weights and cast in FSDP2's mixed precision or autocast)
and buffers. The memory model's figure for the same thing is the `params`
term of rank 0's pipeline stage (planner.memory.phases.StageBytes.params:
parameters after TP, PP and ZeRO, plus buffers), re-estimated from the plan
as it is. The model's other terms (compute-dtype copies, gradients,
optimizer states, activations, buffers, the peak) follow, labelled as
predictions: nothing runs in a dry run. `meshplan validate-memory` measures
those with PyTorch's tracker.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from executor.model import build_model
from executor.parallel.mesh import build_mesh, dp_flat
from executor.parallel.parallelize import compute_dtype, shard
from planner.layout import MESH_AXES, stage_ranges
from planner.plan import Plan
from planner.run_flags import RunFlags
from topologies.terminal import Progress, console, dumps_json

MIB = 1 << 20
GIB = 1 << 30


def _unit(n_bytes: float) -> tuple[str, int]:
    """The unit that shows `n_bytes` with three significant figures: KiB, MiB or GiB."""
    return ("GiB", GIB) if n_bytes >= 10 * GIB else ("MiB", MIB) if n_bytes >= MIB else ("KiB", 1024)


def _size(n_bytes: float, unit: tuple[str, int] | None = None) -> str:
    name, scale = unit or _unit(n_bytes)
    return f"{n_bytes / scale:,.1f} {name}"


def dry_run(plan: Plan, *, plan_path: Path | None = None, flags: RunFlags | None = None, nnodes: int | None = None,
            node_rank: int = 0, rdzv_endpoint: str | None = None, max_restarts: int = 0, found=None) -> None:
    """Print the launch, the preflight's verdict, the batch, rank 0's mesh, modules, shards and memory.

    `found` (executor.preflight.Found) is this machine's hardware; None detects it.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = console()
    if not out.is_terminal:
        out.width = 140  # a pipe or a file: do not wrap tables at 80 columns
    out.print(f"dry run: {plan.model.name} on {plan.world_size} ranks; rank 0 built under a fake process group "
              "on the meta device (no communication, no memory, nothing trained)")
    nnodes = plan.cluster.n_nodes if nnodes is None else nnodes
    for line in launch_lines(plan, plan_path, flags or RunFlags(), nnodes, node_rank, rdzv_endpoint, max_restarts):
        out.print(line, soft_wrap=True)
    out.print(hardware_line(plan, nnodes, found), soft_wrap=True)
    for line in batch_lines(plan):
        out.print(line, soft_wrap=True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        with Progress(f"dry run: building rank 0 of {plan.world_size} on the meta device"):
            mesh = build_mesh(plan, "cpu")
            parts, stages, dp_kind, _ = shard(build_model(plan.model), plan, mesh,
                                              compute_dtype(plan, torch.device("cpu")))
        _print_mesh(out, plan, mesh)
        _print_modules(out, plan, dp_kind)
        stored = _print_shards(out, plan, parts, stages)
        for line in memory_lines(plan, stored):
            out.print(line, soft_wrap=True)
    finally:
        dist.destroy_process_group()


def launch_lines(plan: Plan, plan_path: Path | None, flags: RunFlags, nnodes: int, node_rank: int,
                 rdzv_endpoint: str | None, max_restarts: int = 0) -> list[str]:
    """Nodes, ranks, the rendezvous and this node's torchrun command (executor.launch builds it)."""
    from executor.launch import run_id, torchrun_argv

    cluster = plan.cluster
    per_node = cluster.gpus_per_node
    where = "CPU ranks on gloo" if cluster.gpu.kind == "cpu" else f"{cluster.gpu.name} GPUs, cuda:LOCAL_RANK on NCCL"
    first = node_rank * per_node
    lines = [f"nodes: {nnodes} x {per_node} ranks ({where}) = {nnodes * per_node} ranks; this is node {node_rank} "
             f"(global ranks {first}-{first + per_node - 1})"]
    rid = run_id(dumps_json(plan.to_json()) + "\n")  # the text execute writes to the run's plan.json
    if rdzv_endpoint is None and nnodes > 1:
        lines.append(f"rendezvous: none given; every node needs --nnodes {nnodes} --node-rank R --rdzv-endpoint "
                     "HOST:PORT (node 0's address); --print-launch torchrun prints the commands")
        return lines
    lines.append("rendezvous: standalone (one node: torchrun picks a free local port)" if rdzv_endpoint is None else
                 f"rendezvous: c10d at {rdzv_endpoint}, run id {rid} (every node derives it from the plan's text)")
    run_dir = Path(flags.out) if flags.out else Path("runs") / (plan_path.stem if plan_path else "plan")
    worker = [str(run_dir / "plan.json"), *flags.replace(out=str(run_dir)).to_argv()]
    argv = torchrun_argv(per_node, nnodes, rdzv_endpoint, max_restarts, rid, worker, grace_s=flags.preempt_grace_s,
                         elastic=flags.replan and max_restarts > 0)
    lines.append("this node would start: torchrun " + " ".join(argv))
    return lines


def hardware_line(plan: Plan, nnodes: int, found=None) -> str:
    """The preflight's verdict on this machine, as `execute` would reach it (executor.preflight)."""
    from executor.preflight import Found, check_hardware, expected_gpu
    from topologies.errors import MeshplanError

    found = Found.detect() if found is None else found
    per_node = plan.cluster.gpus_per_node
    if plan.cluster.gpu.kind == "cpu":
        here = (f"{_size(found.host_available_bytes)} of host memory available" if found.host_available_bytes
                else "host memory unknown")
        head = f"hardware: the plan expects {per_node} CPU ranks per node; here: {here}"
    else:
        head = f"hardware: the plan expects {per_node} x {expected_gpu(plan)} per node; here: {found.describe()}"
    try:
        notes = check_hardware(plan, found, nnodes)
    except MeshplanError as exc:
        return f"{head}; a run here would be refused: {exc}"
    return f"{head}; a run here would start" + "".join(f" ({note})" for note in notes)


def batch_lines(plan: Plan) -> list[str]:
    """The global batch cut into data-parallel shards, micro-batches and (with cp) sequence chunks."""
    layout, training = plan.layout, plan.training
    per_replica = layout.micro_batch_size * layout.grad_accum_steps
    lines = [f"batch: {training.global_batch_size} sequences x {training.seq_len} tokens = "
             f"{training.tokens_per_step:,} tokens per optimizer step; dp {layout.dp} x {per_replica} sequences "
             f"per data-parallel rank = {layout.grad_accum_steps} micro-batch(es) of {layout.micro_batch_size}"]
    if layout.pp > 1:
        lines.append(f"  pipeline: the {layout.pp_schedule} schedule runs the {layout.grad_accum_steps} micro-batches "
                     f"through {layout.pp * layout.virtual_stages} stages on {layout.pp} pipeline ranks")
    elif layout.grad_accum_steps > 1:
        lines.append(f"  gradient accumulation: {layout.grad_accum_steps} forward/backward passes per step, "
                     "gradients synchronized " + ("on every one (FSDP2 reduce-scatters)" if layout.zero_stage >= 2
                                                  else "after the last"))
    if layout.cp > 1:
        lines.append(f"  context parallel {layout.cp}: each rank holds {training.seq_len // layout.cp} tokens of every "
                     "sequence (two load-balanced chunks)")
    return lines


def _print_mesh(out, plan: Plan, mesh) -> None:
    shape = dict(zip(MESH_AXES, plan.layout.mesh_shape, strict=True))
    out.print("mesh " + " x ".join(f"{axis} {size}" for axis, size in shape.items()))
    groups = {axis: mesh[axis].mesh.flatten().tolist() for axis in MESH_AXES}
    groups["dp"] = dp_flat(mesh).mesh.flatten().tolist()
    out.print("  rank 0's groups: " + "; ".join(f"{axis} {ranks}" for axis, ranks in groups.items()))


def _print_modules(out, plan: Plan, dp_kind: str) -> None:
    from rich.table import Table

    layout, spec = plan.layout, plan.model
    n_stages = layout.pp * layout.virtual_stages
    table = Table(title="modules per pipeline rank", title_justify="left")
    for col in ("pp rank", "stages", "layers", "also holds"):
        table.add_column(col)
    for pp_rank in range(layout.pp):
        ids = layout.stages_of(pp_rank) if layout.pp > 1 else (0,)
        layers = [stage_ranges(layout.layers_per_stage)[s] for s in ids] if layout.pp > 1 else [range(spec.n_layers)]
        extras = (["embeddings"] if 0 in ids else []) + (["final norm, output"] if n_stages - 1 in ids else [])
        table.add_row(str(pp_rank), ", ".join(map(str, ids)),
                      ", ".join(f"{r.start}-{r.stop - 1}" for r in layers), ", ".join(extras))
    out.print(table)
    if layout.tp > 1:
        t = layout.tp
        out.print(f"tensor parallel {t}{' + sequence parallel' if layout.sequence_parallel else ''}: each rank runs "
                  f"{spec.n_heads // t} of {spec.n_heads} query heads, {spec.n_kv_heads // t} of {spec.n_kv_heads} "
                  f"KV heads, {spec.ffn_hidden // t} of {spec.ffn_hidden} MLP columns", soft_wrap=True)
    out.print("data parallel: " + _dp_text(plan, dp_kind), soft_wrap=True)
    if layout.recompute != "none":
        out.print(f"activation checkpointing: {layout.recompute} (per block)")


def _dp_text(plan: Plan, dp_kind: str) -> str:
    layout = plan.layout
    if dp_kind == "none":
        return "none (dp 1)"
    if dp_kind == "fsdp":
        how = "HSDP: replicate over dp_replicate, shard over dp_shard" if layout.hsdp else "shard over dp_shard"
        again = "frees gathered parameters after forward" if layout.zero_stage == 3 else "keeps them until backward"
        return f"ZeRO-{layout.zero_stage} with fully_shard per block and root ({how}, {layout.dp} ranks); {again}"
    wrapper = "DDP" if dp_kind == "ddp" else "replicate (DDP on FSDP2, for DTensors and pipeline stages)"
    text = f"{wrapper} over dp ({layout.dp} ranks): full replicas, gradients all-reduced"
    if layout.zero_stage == 1 and dp_kind == "ddp":
        text += f"; ZeroRedundancyOptimizer shards AdamW states over dp_shard ({layout.shard_ranks})"
    elif layout.zero_stage == 1:
        text += f"; AdamW states sharded over the gradient group (executor.components.zero1, {layout.dp * layout.cp} ranks)"
    return text


def _print_shards(out, plan: Plan, parts: list, stages: list[int]) -> dict[str, int]:
    """The parameter table; returns what rank 0 stores: {"elements", "param_bytes", "buffer_bytes"}."""
    from rich.table import Table
    from torch.distributed.tensor import DTensor

    rows: OrderedDict[tuple, int] = OrderedDict()
    elements = param_bytes = buffer_bytes = 0
    for part in parts:
        for fqn, p in part.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            placements = ", ".join(map(str, p.placements)) if isinstance(p, DTensor) else "plain (replicated)"
            key = (re.sub(r"^layers\.\d+\.", "layers.*.", fqn), tuple(p.shape), tuple(local.shape), placements)
            rows[key] = rows.get(key, 0) + 1
            elements += local.numel()
            param_bytes += local.numel() * local.element_size()
        buffer_bytes += sum(b.numel() * b.element_size() for b in part.buffers())
    table = Table(title=f"parameters of rank 0 (stages {stages})", title_justify="left")
    for col in ("name", "count", "global shape", "local shape", "placements"):
        table.add_column(col)
    for (name, shape, local, placements), count in rows.items():
        table.add_row(name, str(count), str(list(shape)), str(list(local)), placements)
    out.print(table)
    out.print(f"rank 0 holds {elements:,} parameter elements = {_size(param_bytes)} in fp32")
    return {"elements": elements, "param_bytes": param_bytes, "buffer_bytes": buffer_bytes}


def memory_lines(plan: Plan, stored: dict[str, int]) -> list[str]:
    """Rank 0's stored bytes next to the memory model's for the same thing, then the model's other terms."""
    from planner.memory.estimate import estimate_memory

    est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine)
    modelled = est.stages[0][0].params
    built = stored["param_bytes"] + stored["buffer_bytes"]
    error = (modelled - built) / built if built else 0.0
    unit = _unit(max(built, modelled))
    lines = [f"memory of rank 0 (pipeline stage 0), like for like: parameters {_size(stored['param_bytes'], unit)} + "
             f"buffers {_size(stored['buffer_bytes'])} = {_size(built, unit)} built here; the memory model's "
             f"params term for this rank: {_size(modelled, unit)} ({error:+.1%})"]
    stage0 = dict(est.per_stage[0])
    peak = sum(stage0.values())
    terms = {"weight copies and gathered shards": stage0.pop("params") - modelled, **stage0}
    unit = _unit(peak)
    lines.append("  the memory model's other terms for this rank at its peak (predicted: a dry run measures none of "
                 "them): " + ", ".join(f"{name.replace('_', ' ')} {_size(value, unit)}" for name, value in terms.items())
                 + f"; peak {_size(peak, unit)} (other: CUDA context, NCCL and the caching allocator's reserve)")
    if est.worst_stage != 0:
        lines.append(f"  worst rank: {est.worst_rank} (pipeline stage {est.worst_stage}), {_size(est.peak_bytes)} "
                     f"at {est.peak_phase}")
    lines.append("  `meshplan validate-memory PLAN` runs one step under PyTorch's memory tracker to measure the rest")
    return lines
