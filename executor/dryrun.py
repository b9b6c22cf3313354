"""`execute --dry-run`: build rank 0 exactly as a run would, under a fake process group, and print it.

The fake backend (torch.testing._internal.distributed.fake_pg: FakeStore +
backend "fake") lets one process claim to be rank 0 of the plan's world
without any peer: init_device_mesh, parallelize_module and fully_shard run
for real on the meta device, so the printed mesh, modules and parameter
shards are those a run would build, for any model size, with no memory and
no GPU. DDP and ZeroRedundancyOptimizer need real tensors and are described
instead of built (they keep full replicas, which change no shard).
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch
import torch.distributed as dist

from executor.model import build_model
from executor.parallel.mesh import build_mesh, dp_flat
from executor.parallel.parallelize import compute_dtype, shard
from planner.layout import MESH_AXES, stage_ranges
from planner.plan import Plan
from topologies.terminal import Progress, console

MIB = 1 << 20


def dry_run(plan: Plan) -> None:
    """Print rank 0's mesh, the modules of every pipeline rank and rank 0's parameter shards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        with Progress(f"dry run: building rank 0 of {plan.world_size} on the meta device"):
            mesh = build_mesh(plan, "cpu")
            parts, stages, dp_kind, _ = shard(build_model(plan.model), plan, mesh,
                                              compute_dtype(plan, torch.device("cpu")))
        out = console()
        if not out.is_terminal:
            out.width = 140  # a pipe or a file: do not wrap tables at 80 columns
        out.print(f"dry run: {plan.model.name} on {plan.world_size} ranks; rank 0 built under a fake process group "
                  "on the meta device (no communication, no memory, nothing trained)")
        _print_mesh(out, plan, mesh)
        _print_modules(out, plan, dp_kind)
        _print_shards(out, plan, parts, stages)
    finally:
        dist.destroy_process_group()


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
                  f"KV heads, {spec.ffn_hidden // t} of {spec.ffn_hidden} MLP columns")
    out.print("data parallel: " + _dp_text(plan, dp_kind))
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
    wrapper = "DDP" if dp_kind == "ddp" else "replicate (DDP on FSDP2, for TP's DTensors)"
    text = f"{wrapper} over dp ({layout.dp} ranks): full replicas, gradients all-reduced"
    if layout.zero_stage == 1:
        text += f"; ZeroRedundancyOptimizer shards AdamW states over dp_shard ({layout.dp_shard})"
    return text


def _print_shards(out, plan: Plan, parts: list, stages: list[int]) -> None:
    from rich.table import Table
    from torch.distributed.tensor import DTensor

    rows: OrderedDict[tuple, int] = OrderedDict()
    total = 0
    for part in parts:
        for fqn, p in part.named_parameters():
            local = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
            placements = ", ".join(map(str, p.placements)) if isinstance(p, DTensor) else "plain (replicated)"
            key = (re.sub(r"^layers\.\d+\.", "layers.*.", fqn), tuple(p.shape), local, placements)
            rows[key] = rows.get(key, 0) + 1
            total += _numel(local)
    table = Table(title=f"parameters of rank 0 (stages {stages})", title_justify="left")
    for col in ("name", "count", "global shape", "local shape", "placements"):
        table.add_column(col)
    for (name, shape, local, placements), count in rows.items():
        table.add_row(name, str(count), str(list(shape)), str(list(local)), placements)
    out.print(table)
    line = f"rank 0 holds {total:,} parameter elements = {total * 4 / MIB:,.1f} MiB in fp32"
    if plan.prediction is not None and "params" in plan.prediction.memory_breakdown_bytes:
        line += f" (the plan's memory model: {plan.prediction.memory_breakdown_bytes['params'] / MIB:,.1f} MiB of params)"
    out.print(line)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
