"""The model's ends in a step: the embedding on the first chunk, final norm, output layer and loss
on the last, each with its host work and the communication only the ends have (FSDP's root
units, TP's embedding and output collectives). `planner.simulate.step` places them on the
pipeline's chunks.
"""

from __future__ import annotations

from planner.engines import Engine
from planner.layout import Layout
from planner.memory.params import stage_params
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.collectives import fsdp_gathers_per_micro_batch, root_units
from planner.simulate.comm import StepComm
from planner.simulate.compute import combine, embedding_times, output_times, tokens_per_micro_batch
from planner.simulate.host import end_host_s
from planner.simulate.lora import frozen_end
from planner.simulate.offload import exposed_beyond
from planner.simulate.pipeline import chunk_owner
from planner.training import DTYPE_BYTES, TrainingSpec
from topologies.cluster import Cluster


def ends_s(model: ModelSpec, training: TrainingSpec, layout: Layout, peak: float, cluster: Cluster,
          cal: CalibrationProfile) -> tuple[float, float, float, float]:
    """(embedding F, embedding B, output F, output B) per micro-batch, host overhead included."""
    gpu, s = cluster.gpu, training.seq_len
    emb = frozen_end(training, embedding_times(model, s, training.dtype_bytes, layout, gpu, cal))
    out = frozen_end(training, output_times(model, s, layout, gpu, peak, cal))
    host, p = cal.layer_overhead_s, cal.overlap_exponent
    tp_f, tp_b = end_host_s(layout, cal)
    return (combine(emb.forward_s, host + tp_f, p), combine(emb.backward_s, host + tp_b, p),
            combine(out.forward_s, host + tp_f, p), combine(out.backward_s, 2 * host + tp_b, p))


def root_fsdp_comm_s(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm,
                    cal: CalibrationProfile, ends: tuple[float, float, float, float], engine: Engine
                    ) -> tuple[float, float, float, float]:
    """Exposed FSDP communication of the root units (embedding; final norm with output) per micro-batch.

    The executor shards each stage's embedding and its final norm with the output layer as units of their
    own (ZeRO-2/3); their all-gathers per micro-batch are `fsdp_gathers_per_micro_batch`'s (under ZeRO-3
    the embedding gathers again for its backward, the output unit stays gathered), and each unit
    reduce-scatters its gradient after its backward. The embedding's unit is priced on chunk 0, the
    output's on the last chunk; compute hides it up to `comm_overlap` of that end's own time. On small
    models the vocabulary matrices hold as many parameters as several layers.
    """
    if layout.zero_stage < 2 or layout.shard_ranks == 1:
        return 0.0, 0.0, 0.0, 0.0
    frozen = training.lora  # a frozen root makes no gradient to reduce-scatter (planner.simulate.lora)
    owner = chunk_owner(layout.pp_schedule, layout.pp, layout.virtual_stages)
    hooks = cal.fsdp_call_overhead_s  # FSDP's host work per collective (planner.simulate.host), on the waiting core
    out: list[float] = []
    for end, rank, name in ((0, owner[0], "embedding"), (2, owner[-1], "output")):
        size = dict(root_units(model, stage_params(model, layout, rank))).get(name, 0)
        gathers = fsdp_gathers_per_micro_batch(layout, name, engine) if size else 0
        ag = comm.time_s("all_gather", size * training.dtype_bytes, layout.shard_axes)
        rs = 0.0 if frozen else comm.time_s("reduce_scatter", size * DTYPE_BYTES[training.grad_dtype],
                                            layout.shard_axes)
        ag_f, ag_b = min(1, gathers), max(0, gathers - 1)
        out += [max(0.0, ag_f * ag - cal.comm_overlap * ends[end]) + (hooks if ag_f else 0.0),
                max(0.0, ag_b * ag + rs - cal.comm_overlap * ends[end + 1])
                + (hooks * (ag_b + (0 if frozen else 1)) if size else 0.0)]
    return out[0], out[1], out[2], out[3]


def ends_tp_comm_s(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm
                   ) -> tuple[float, float, float, float]:
    """TP communication of the model's ends per micro-batch (embedding F, B, output F, B).

    A vocabulary-split embedding all-reduces its output (m*h) in the forward;
    the column-split output layer all-reduces its input gradient in the
    backward. Every engine keeps the logits split into its loss (DTensor's
    loss_parallel, Megatron's vocab-parallel cross entropy), so no logits move.
    """
    if layout.tp == 1:
        return 0.0, 0.0, 0.0, 0.0
    d = training.dtype_bytes
    m = tokens_per_micro_batch(training.seq_len, layout)
    act = comm.time_s("all_reduce", m * model.hidden * d, ("tp",))
    emb = 0.0 if model.tie_embeddings else act
    return emb, 0.0, 0.0, act


def root_offload_s(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm,
                   cal: CalibrationProfile, ends: tuple[float, float, float, float]
                   ) -> tuple[float, float, float, float]:
    """Exposed host-link copies of the root units per micro-batch (planner.simulate.offload), beside
    `root_fsdp_comm_s`: with parameters offloaded a root's shard comes up before its all-gather, and with
    either offload its gradient shard goes down after its reduce-scatter. A micro-batch's forward starts with
    the embedding's copy, which no earlier unit's compute can hide: only the end's own time (at
    `comm_overlap`) hides it, as it hides the root's collectives."""
    if layout.offload == "none":
        return 0.0, 0.0, 0.0, 0.0
    d, g = training.dtype_bytes, DTYPE_BYTES[training.grad_dtype]
    shard = layout.shard_ranks if layout.zero_stage >= 1 else 1
    link = comm.host_link_gbytes_per_s * 1e9
    owner = chunk_owner(layout.pp_schedule, layout.pp, layout.virtual_stages)
    out: list[float] = []
    for end, rank in ((0, owner[0]), (2, owner[-1])):
        if end == 2 and rank == owner[0]:
            out += [0.0, 0.0]
            continue
        root = stage_params(model, layout, rank).root
        sharded = layout.zero_stage >= 2 and layout.shard_ranks > 1
        ag = comm.time_s("all_gather", root * d, layout.shard_axes) if sharded and layout.zero_stage == 3 else 0.0
        rs = comm.time_s("reduce_scatter", root * g, layout.shard_axes) if sharded else 0.0
        up = root / shard * d / link if layout.offload == "optimizer+params" else 0.0
        out += [exposed_beyond(up, ag, cal.comm_overlap * ends[end]),
                exposed_beyond(root / shard * g / link, rs, cal.comm_overlap * ends[end + 1])]
    return out[0], out[1], out[2], out[3]
