"""The data-parallel collectives of one optimizer step on one pipeline rank, as a list.

The simulator prices these entries (planner.simulate.step: the layer's FSDP
collectives, the tail's gradient reduction and parameter gathers;
planner.simulate.ends: the root units'), and tests compare them with what the
executor's real runs issue (tests/multiproc/test_collectives.py), so count,
bytes and dtype have one home. Per data-parallel path (Engine.dp_path):

  ddp        one all-reduce of the stage's gradients per step, in DDP_BUCKET_BYTES
             buckets (expert gradients over their expert data-parallel groups)
  replicate  FSDP2's replicate: one all-reduce per unit (each block, and the
             part's root: embedding, final norm and output layer) per step
  fsdp       FSDP2 (ZeRO-2/3, HSDP) on every micro-batch: a reduce-scatter of each
             unit's gradient over the shard axes; ZeRO-2 all-gathers each unit
             once per micro-batch (reshard_after_forward=False keeps it from
             forward to backward, then it is resharded); ZeRO-3 twice, except
             each part's last block and the output unit (not resharded after
             forward); HSDP all-reduces each unit's shard over dp_replicate once
             per step (the last micro-batch)
  ZeRO-1     after the optimizer step, on torch's paths (ddp, replicate), each of
             the shard group's ranks broadcasts the parameters it owns in one
             bucket, in their stored dtype (fp32 master parameters); other
             engines' distributed optimizers all-gather them in the compute dtype
  other      an engine's own data-parallel mechanism: one all-reduce of the gradients

Bytes are of the whole (unsharded) tensor a collective reduces or gathers;
an all-gather's input is size_bytes / group_size per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.engines import DDP_BUCKET_BYTES, FP32_BYTES, Engine
from planner.layout import Layout
from planner.memory.params import StageParams
from planner.model.spec import ModelSpec
from planner.training import DTYPE_BYTES, TrainingSpec

EXPERT_AXES = ("edp",)  # the expert grid's data-parallel groups (StepComm.expert_time_s)


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind per optimizer step on one rank, each of `size_bytes`."""

    name: str  # what it moves: grad_reduce, grad_replicas, param_gather, ...
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast
    axes: tuple[str, ...]  # mesh axes of its group, or EXPERT_AXES
    group_size: int
    size_bytes: float
    dtype_bytes: int
    count: int
    phase: str  # "layer" (inside a micro-batch's passes), "ends" (root units), "tail" (after the last backward)

    @property
    def total_bytes(self) -> float:
        return self.size_bytes * self.count


def output_unit_params(model: ModelSpec, sp: StageParams) -> int:
    """The final norm and the output layer (one FSDP2 unit: executor.parallel.parallelize.apply_fsdp)."""
    if not sp.has_output:
        return 0
    return model.norm_params + (0 if model.tie_embeddings and sp.has_embedding else sp.head)


def root_units(model: ModelSpec, sp: StageParams) -> tuple[tuple[str, int], ...]:
    """The stage's root units with parameters: ("embedding", n) and ("output", n)."""
    out = output_unit_params(model, sp)
    units = (("embedding", sp.root - out), ("output", out))
    return tuple((name, n) for name, n in units if n > 0)


def fsdp_gathers_per_micro_batch(layout: Layout, unit: str, engine: Engine) -> int:
    """All-gathers of one FSDP unit per micro-batch (unit: "block", "last_block", "embedding", "output")."""
    if layout.zero_stage < 2 or layout.shard_ranks == 1:
        return 0
    fsdp2 = engine.dp_path(layout) == "fsdp"
    if layout.zero_stage == 2:  # FSDP2 reshards after each backward; other engines gather once per step (tail)
        return 1 if fsdp2 else 0
    kept = unit == "output" or (unit == "last_block" and fsdp2)  # not resharded after forward
    return 1 if kept else 2


def block_gathers_per_layer(layout: Layout, n_layers: int, engine: Engine) -> float:
    """Average all-gathers of one block per micro-batch (each part's last block may gather once)."""
    chunks = layout.pp * layout.virtual_stages
    last = fsdp_gathers_per_micro_batch(layout, "last_block", engine)
    block = fsdp_gathers_per_micro_batch(layout, "block", engine)
    return (block * (n_layers - chunks) + last * chunks) / n_layers


def zero1_gather_dtype_bytes(training: TrainingSpec, engine: Engine) -> int:
    """Bytes per parameter ZeRO-1 gathers after the step: the stored parameters."""
    return FP32_BYTES if engine.data_parallel.master_params else training.dtype_bytes


def ddp_buckets(size_bytes: float) -> int:
    return max(1, math.ceil(size_bytes / DDP_BUCKET_BYTES))


def dp_collectives(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams, engine: Engine,
                   gather_bytes: int | None = None) -> list[Collective]:
    """The data-parallel collectives one optimizer step issues on a pipeline rank holding `sp` (module docstring).

    gather_bytes: bytes per parameter FSDP all-gathers (1 for float8 all-gathers; default the compute dtype's).
    """
    g, d = DTYPE_BYTES[training.grad_dtype], training.dtype_bytes
    gather_bytes = d if gather_bytes is None else gather_bytes
    n = layout.grad_accum_steps
    path = engine.dp_path(layout)
    out: list[Collective] = []
    if path == "none":
        return out
    dp_size = math.prod(layout.mesh_shape[1:4])  # dp_replicate * dp_shard * cp
    if layout.zero_stage <= 1:
        if path == "replicate":
            units = [sp.block] * sp.layers + ([sp.root] if sp.root else [])  # the part itself holds the ends
            for size in sorted(set(units)):
                count = units.count(size)
                out.append(Collective("grad_reduce", "all_reduce", layout.grad_axes, dp_size, size * g, g, count,
                                      "tail"))
        else:  # torch's DDP reduces in buckets; other engines' own mechanisms priced as one all-reduce
            size = sp.dense * g
            buckets = ddp_buckets(size) if path == "ddp" else 1
            out.append(Collective("grad_reduce", "all_reduce", layout.grad_axes, dp_size, size / buckets, g,
                                  buckets, "tail"))
        if sp.experts:
            out.append(Collective("expert_grad_reduce", "all_reduce", EXPERT_AXES, sp.expert_shard,
                                  sp.experts * g, g, 1, "tail"))
        if layout.zero_stage == 1 and layout.shard_ranks > 1 and path in ("ddp", "replicate"):
            p = zero1_gather_dtype_bytes(training, engine)  # each owner broadcasts its bucket
            out.append(Collective("param_gather", "broadcast", layout.shard_axes, layout.shard_ranks,
                                  sp.dense * p / layout.shard_ranks, p, layout.shard_ranks, "tail"))
        elif layout.zero_stage == 1 and layout.shard_ranks > 1:  # distributed optimizers all-gather
            out.append(Collective("param_gather", "all_gather", layout.shard_axes, layout.shard_ranks,
                                  sp.dense * d, d, 1, "tail"))
        return out
    shard = layout.shard_ranks
    units: list[tuple[str, str, int]] = [("layer", "block", sp.block)] * sp.layers
    units += [("ends", name, size) for name, size in root_units(model, sp)]
    for phase, name, size in units:
        if shard > 1:
            out.append(Collective(f"{name}_grad_reduce", "reduce_scatter", layout.shard_axes, shard, size * g, g, n,
                                  phase))
        if layout.dp_replicate > 1:
            out.append(Collective(f"{name}_grad_replicas", "all_reduce", ("dp_replicate",), layout.dp_replicate,
                                  size * g / shard, g, 1, "tail"))
    gathers = [(phase, name, size, fsdp_gathers_per_micro_batch(layout, name, engine))
               for phase, name, size in units]
    if gathers and gathers[0][1] == "block" and sp.layers:  # each part's last block (chunks of this rank)
        chunks = layout.virtual_stages
        last = fsdp_gathers_per_micro_batch(layout, "last_block", engine)
        gathers = [(p, nm, s, last if i >= sp.layers - chunks and nm == "block" else k)
                   for i, (p, nm, s, k) in enumerate(gathers)]
    for phase, name, size, k in gathers:
        if k and shard > 1:
            out.append(Collective(f"{name}_param_gather", "all_gather", layout.shard_axes, shard,
                                  size * gather_bytes, gather_bytes, k * n, phase))
    if layout.zero_stage == 2 and path != "fsdp" and shard > 1:  # gathered once after the step
        out.append(Collective("param_gather", "all_gather", layout.shard_axes, shard, sp.dense * d, d, 1, "tail"))
    return _merged(out)


def _merged(entries: list[Collective]) -> list[Collective]:
    """Entries equal but for their count, summed (a stage's equal blocks)."""
    merged: dict[tuple, Collective] = {}
    for c in entries:
        key = (c.name, c.kind, c.axes, c.group_size, c.size_bytes, c.dtype_bytes, c.phase)
        if key in merged:
            prev = merged[key]
            merged[key] = Collective(*key[:6], prev.count + c.count, c.phase)
        else:
            merged[key] = c
    return list(merged.values())
