"""One training step of a fully specified layout: compute, communication, pipeline events.

Recipe (all times per micro-batch unless said otherwise):
1. a layer's forward F and backward B (+ W in zero-bubble schedules) from
   `planner.simulate.compute` (FSDP's copies around its collectives included), host
   work (`planner.simulate.host`: eager dispatch, DTensor's operators under TP,
   FSDP's hooks) overlapped with GPU time (`combine`), plus
   the communication on the layer's critical path: TP points, the CP ring (or
   PyTorch's K/V all-gather and its merges, `planner.simulate.context`) and
   FSDP gathers beyond what the compute hides, EP all-to-alls (under another
   micro-batch's compute with the recipe's moe_a2a_overlap)
   (`planner.simulate.comm`); compute hides at most the calibration's
   `comm_overlap` share of its own time (0 on CPU ranks sharing their cores);
2. a chunk (virtual stage) is its layers, plus the embedding on chunk 0 and
   the output layer and loss on the last chunk: the imbalance is real; the
   ends carry their own communication: the FSDP root unit's gather and
   reduce-scatter, TP's embedding and output all-reduces and, for engines
   without a vocabulary-parallel loss, the logits all-gather;
3. the pipeline schedule runs as events (`planner.simulate.pipeline`); each rank's
   busy and idle time come out of it; where ranks share cores (calibration
   `solo_speedup` > 1) each stage's operations are re-priced by how much of
   their time the other stages idle, and the schedule runs again;
4. after its last backward a rank reduces gradients over data parallel (the
   part the last micro-batch's backward cannot hide when the engine overlaps,
   all of it when it does not), steps the optimizer and, under ZeRO-1/2,
   all-gathers the updated parameters. Step time = the slowest rank.

Breakdown (on the slowest rank, summing to the step time): compute, exposed
communication (tp_comm, cp_comm, ep_comm, fsdp_comm, offload_comm, dp_comm,
param_gather, embedding_sync), bubble (idle inside the pipeline, p2p waits
included) and optimizer (on the host, transfers included, when offloaded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from planner.engines import DDP_BUCKET_BYTES, Engine, get_engine
from planner.layout import V_SCHEDULES, Layout, recomputed_fraction
from planner.memory.estimate import MemoryEstimate, estimate_memory
from planner.memory.params import StageParams, layer_params_split, pipeline_params
from planner.model.spec import ModelSpec
from planner.plan import Prediction, with_stage_layers
from planner.simulate.calibration import CalibrationProfile, load_calibration
from planner.simulate.collectives import block_gathers_per_layer, dp_collectives, fsdp_gathers_per_micro_batch
from planner.simulate.comm import StepComm, collective_time_s, expert_comm_s
from planner.simulate.compute import (
    COMPILE_HOST_FACTOR,
    PassTimes,
    combine,
    fp8_cast_bytes,
    fp8_peak_flops,
    fsdp_copy_times,
    gemm_flops,
    layer_attention_core_times,
    layer_gemms,
    layer_times,
    optimizer_time_s,
    tokens_per_micro_batch,
)
from planner.simulate.context import torch_cp_cost
from planner.simulate.ends import ends_s, ends_tp_comm_s, root_fsdp_comm_s, root_offload_s
from planner.simulate.events import LAYER_COMM_KEYS, StepEvents, step_events_of
from planner.simulate.grad_fold import add_grad_fold
from planner.simulate.host import layer_host_s, layer_host_scale, solo_repriced
from planner.simulate.lora import (
    lora_layer_times,
    model_flops_per_token,
    trainable_layer_params,
    trainable_stage_params,
)
from planner.simulate.offload import layer_offload_s, offload_summary, offloaded_step_s
from planner.simulate.pipeline import B, F, W, chunk_owner, simulate_pipeline
from planner.simulate.recompute import recomputed_comm
from planner.simulate.tp_overlap import OverlapGemms, async_tp_exposed_s, overlap_gemms, sm_share_s
from planner.training import DTYPE_BYTES, TrainingSpec
from topologies.cluster import Cluster
from topologies.errors import PlanError


@dataclass(frozen=True)
class StepResult:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float  # model FLOPs (no recompute) per GPU per second / 1e12
    mfu: float  # model FLOP/s per GPU over the dense peak of the compute dtype
    time_breakdown_s: dict[str, float]  # on the slowest rank; sums to step_time_s
    memory: MemoryEstimate
    critical_stage: int  # pipeline rank that finishes last
    events: StepEvents | None = field(default=None, compare=False)
    # what the pipeline schedule ran: durations[kind][chunk] (F, B, W, W only under the V schedules; FO, BO under
    # dualpipev) and the p2p time of each chunk boundary (planner.simulate.pipeline.simulate_pipeline's inputs)
    pipeline_inputs: tuple[tuple[tuple[float, ...], ...], tuple[float, ...]] | None = field(
        default=None, compare=False, repr=False)
    offload: dict | None = None  # planner.simulate.offload.offload_summary of an offloading layout

    def prediction(self) -> Prediction:
        return Prediction(
            step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s,
            model_tflops_per_gpu=self.model_tflops_per_gpu, mfu=self.mfu,
            peak_memory_bytes=self.memory.peak_bytes,
            memory_breakdown_bytes=dict(self.memory.breakdown_bytes),
            time_breakdown_s=dict(self.time_breakdown_s),
            extra={"worst_rank": self.memory.worst_rank, "worst_stage": self.memory.worst_stage,
                   "critical_stage": self.critical_stage, "host_memory_bytes": self.memory.host_bytes,
                   "memory_peak_phase": self.memory.peak_phase,
                   # planner.memory.reserved: tensors (max_memory_allocated) and the caching allocator's
                   # high-water mark (max_memory_reserved); peak_memory_bytes adds the fixed overhead
                   "allocated_peak_bytes": self.memory.allocated_bytes,
                   "reserved_peak_bytes": self.memory.reserved_bytes,
                   **({"offload": self.offload} if self.offload else {})},
        )


@dataclass(frozen=True)
class _Unit:
    """Per micro-batch times of one layer: whole passes, and the communication inside them."""

    f: float  # forward pass, communication included
    b: float  # backward pass (recompute + B + W), communication included
    w: float  # weight-gradient part of b (only split out for zero-bubble schedules)
    comm_f: dict[str, float]  # exposed communication inside f, by kind
    comm_b: dict[str, float]


def _layer_comm(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm, fwd_s: float,
                bwd_s: float, attention_s: float, tp_hidden_s: float, gather_bytes: int, eng: Engine,
                overlap: float = 1.0,
                async_gemms: OverlapGemms | None = None, cp_ring: bool = True
                ) -> tuple[dict[str, float], dict[str, float], int, int]:
    """Exposed communication of one layer pass (forward, backward) and the collectives each issues.

    gather_bytes: bytes per parameter FSDP all-gathers (1 for float8 all-gathers, else the dtype's).
    Compute hides communication only up to `overlap` (the calibration's
    comm_overlap) of its own time: 0 where collectives run on the computing cores.
    async_gemms: under async TP, the GEMMs each TP collective is pipelined with
    (planner.simulate.tp_overlap); the backward keeps the better of that and tp_hidden_s.
    cp_ring: price context parallelism as a p2p ring here (ContextParallel.rotate "ring"); the
    all-gather kind is priced by the caller (planner.simulate.context).
    """
    raw_overlap = overlap
    fwd_s, bwd_s, attention_s, tp_hidden_s = (overlap * t for t in (fwd_s, bwd_s, attention_s, tp_hidden_s))
    d = training.dtype_bytes
    m = tokens_per_micro_batch(training.seq_len, layout)
    act = m * model.hidden * d
    comm_f, comm_b = dict.fromkeys(LAYER_COMM_KEYS, 0.0), dict.fromkeys(LAYER_COMM_KEYS, 0.0)
    calls_f = calls_b = 0
    redo_points, redo_a2a = recomputed_comm(model, layout)  # selectively recomputed mlp / moe modules
    if layout.tp > 1:
        per_point = 2 if layout.sequence_parallel else 1
        points_b = 2 + 2 * recomputed_fraction(layout, model.n_layers) + redo_points
        point = comm.tp_point_s(act, layout.sequence_parallel)
        # the backward's own 2 points can hide under tp_hidden_s; recomputed forward points cannot
        comm_f["tp_comm"] = 2 * point
        comm_b["tp_comm"] = (points_b - 2) * point + max(0.0, 2 * point - tp_hidden_s)
        if async_gemms is not None and layout.sequence_parallel:
            ag, rs = comm.time_s("all_gather", act, ("tp",)), comm.time_s("reduce_scatter", act, ("tp",))
            fwd, bwd = async_tp_exposed_s(async_gemms, ag, rs, raw_overlap)
            comm_f["tp_comm"] = fwd
            comm_b["tp_comm"] = (points_b - 2) / 2 * fwd + min(max(0.0, 2 * point - tp_hidden_s), bwd)
        calls_f, calls_b = 2 * per_point, round(points_b * per_point)
    if layout.cp > 1 and cp_ring:  # the ring hides under the attention core of the same pass
        ring = comm.cp_ring_s(2 * m * model.kv_dim / layout.tp * d, layout.cp)
        comm_f["cp_comm"] = max(0.0, ring - attention_s)
        comm_b["cp_comm"] = max(0.0, 2 * ring - 2 * attention_s)
        calls_f, calls_b = calls_f + layout.cp - 1, calls_b + 2 * (layout.cp - 1)
    if model.moe is not None and layout.ep * layout.etp > 1:
        ep_s, calls = expert_comm_s(model, layout, comm, act)
        ep_b = ep_s * (1.0 + redo_a2a)  # a recomputed MoE layer dispatches and combines again
        comm_f["ep_comm"], comm_b["ep_comm"] = ep_s, ep_b
        if training.moe_a2a_overlap:  # one micro-batch's forward runs beside another's backward: each
            # pass's all-to-alls hide under the other pass's compute (warm-up and cool-down passes ignored)
            comm_f["ep_comm"], comm_b["ep_comm"] = max(0.0, ep_s - bwd_s), max(0.0, ep_b - fwd_s)
        calls_f, calls_b = calls_f + calls, calls_b + round(calls * (1.0 + redo_a2a))
    ag = rs = 0.0
    if layout.zero_stage >= 2 and layout.shard_ranks > 1:  # prefetched: only what compute cannot hide
        # an average layer's unit: its gathers per micro-batch as planner.simulate.collectives counts them
        dense, experts = layer_params_split(model, layout.tp, layout.ep, layout.etp)
        rs = comm.time_s("reduce_scatter", sum(trainable_layer_params(model, training, layout))
                         * DTYPE_BYTES[training.grad_dtype], layout.shard_axes)
        ag = comm.time_s("all_gather", (dense + experts) * gather_bytes, layout.shard_axes)
        ag_f = min(1, fsdp_gathers_per_micro_batch(layout, "block", eng))
        ag_b = block_gathers_per_layer(layout, model.n_layers, eng) - ag_f
        comm_f["fsdp_comm"] = max(0.0, ag_f * ag - fwd_s)
        comm_b["fsdp_comm"] = max(0.0, ag_b * ag + rs - bwd_s)
        calls_f, calls_b = calls_f + ag_f, calls_b + 1 + round(ag_b)
        ag = ag if layout.zero_stage == 3 else 0.0  # what a parameter offload's copies chain behind
    if layout.offload != "none":  # shards up from host memory, gradient shards down (planner.simulate.offload)
        comm_f["offload_comm"], comm_b["offload_comm"] = layer_offload_s(
            model, layout, d, DTYPE_BYTES[training.grad_dtype], comm.host_link_gbytes_per_s, fwd_s, bwd_s, ag, rs)
    return comm_f, comm_b, calls_f, calls_b


def _layer_unit(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm, peak: float,
                cluster: Cluster, cal: CalibrationProfile, eng: Engine) -> _Unit:
    """One layer's passes: the GPU runs compute then exposed comm; the host issues the layer's
    kernels (layer_overhead_s per forward scaled by the operations the layer dispatches,
    planner.simulate.launches; twice per backward, once more to recompute) and one
    dispatch per collective (collective_overhead_s); the two overlap (`combine`)."""
    fused = eng.fused_attention(training)
    lt = layer_times(model, training.seq_len, training.dtype_bytes, layout, cluster.gpu, peak, cal, fused,
                     fp8_peak=fp8_peak_flops(training.precision, cluster.gpu), compile=training.compile,
                     cast_bytes=fp8_cast_bytes(training.precision, cluster.gpu))
    attention = lt.forward_s - lt.backward_weight_s  # attention core + elementwise: what a CP ring overlaps
    lt = lora_layer_times(model, training, layout, cluster.gpu, peak, cal, lt)
    lt = lt + fsdp_copy_times(model, training.dtype_bytes, DTYPE_BYTES[training.grad_dtype], layout, cluster.gpu, cal,
                              sum(trainable_layer_params(model, training, layout)) if training.lora else None)
    async_gemms = None
    if training.async_tp and layout.tp > 1 and layout.sequence_parallel:  # GEMMs run as tp chunks
        async_gemms = overlap_gemms(model, tokens_per_micro_batch(training.seq_len, layout), layout, peak, cal,
                                    fp8_peak_flops(training.precision, cluster.gpu))
        act = tokens_per_micro_batch(training.seq_len, layout) * model.hidden * training.dtype_bytes
        sm_f, sm_dgrad, sm_wgrad = sm_share_s(async_gemms, eng.tp_overlap_sms(training), cluster.gpu.sm_count,
                                              comm.time_s("all_gather", act, ("tp",)),
                                              comm.time_s("reduce_scatter", act, ("tp",)))
        chunk = async_gemms.chunking_s
        redo = (chunk + sm_f) * recomputed_fraction(layout, model.n_layers) if layout.recompute == "full" else 0.0
        lt = lt + PassTimes(chunk + sm_f, chunk + sm_dgrad, sm_wgrad, redo)
    cp_ring = eng.context_parallel.rotate == "ring"
    if not cp_ring and layout.cp > 1:  # torch's context_parallel (planner.simulate.context)
        core_f, core_b = layer_attention_core_times(model, training.seq_len, training.dtype_bytes, layout,
                                                    cluster.gpu, peak, cal, fused)
        cp = torch_cp_cost(model, training.seq_len, training.dtype_bytes, layout, comm, cluster.gpu, cal,
                           core_f, core_b, repeats_kv=eng.model_code.repeats_kv, compile=training.compile)
        lt = lt + PassTimes(cp.forward_s, cp.backward_s, 0.0, cp.recompute_s)
    tp_hidden = lt.backward_weight_s if eng.tensor_parallel.backward_overlap else 0.0
    gather_bytes = 1 if eng.fp8.fp8_all_gather and training.fp8 else training.dtype_bytes
    comm_f, comm_b, calls_f, calls_b = _layer_comm(model, training, layout, comm, lt.forward_s,
                                                   lt.backward_s, attention, tp_hidden, gather_bytes, eng,
                                                   cal.comm_overlap, async_gemms, cp_ring)
    if not cp_ring and layout.cp > 1:
        comm_f["cp_comm"], comm_b["cp_comm"] = cp.comm_f, cp.comm_b
        calls_f, calls_b = calls_f + cp.calls_f, calls_b + cp.calls_b
    p = cal.overlap_exponent
    host = cal.layer_overhead_s * (COMPILE_HOST_FACTOR if training.compile else 1.0)
    scale_f, scale_b = layer_host_scale(model, training, layout, fused)
    host_f, host_b = layer_host_s(model, layout, cal, host * scale_f, (calls_f, calls_b), host * scale_b)
    f = combine(lt.forward_s + sum(comm_f.values()), host_f, p)
    b = combine(lt.backward_s + sum(comm_b.values()), host_b, p)
    w = (b - sum(comm_b.values())) * lt.backward_weight_s / lt.backward_s if lt.backward_s else 0.0
    return _Unit(f, b, w, comm_f, comm_b)


def _mtp_ends(model: ModelSpec, unit: _Unit, ends: tuple[float, float, float, float]
              ) -> tuple[float, float, float, float]:
    """The last stage also runs the multi-token-prediction modules: one layer and one more
    output-layer pass each (DeepSeek-V3's MTP shares the output layer)."""
    if not model.mtp_layers:
        return ends
    k = model.mtp_layers
    return ends[0], ends[1], ends[2] * (1 + k) + k * unit.f, ends[3] * (1 + k) + k * unit.b


def _chunk_durations(layout: Layout, unit: _Unit, ends: tuple[float, float, float, float],
                     split_w: bool, ends_comm: dict[str, tuple[float, float, float, float]] | None = None
                     ) -> tuple[list[list[float]], list[float], dict[str, list[float]]]:
    """durations[kind][chunk], per-chunk compute and exposed comm by kind for one micro-batch.

    `ends` include the exposed communication `ends_comm` (by kind: fsdp_comm, tp_comm), counted as such."""
    ends_comm = ends_comm or {}
    n_chunks = layout.pp * layout.virtual_stages
    durations: list[list[float]] = [[], [], []]
    compute = []
    comm_kinds: dict[str, list[float]] = {k: [] for k in LAYER_COMM_KEYS}
    cf, cb = sum(unit.comm_f.values()), sum(unit.comm_b.values())
    per_layer = [(k, unit.comm_f[k] + unit.comm_b[k]) for k in LAYER_COMM_KEYS]
    for c, layers in enumerate(layout.layers_per_stage):
        first, last = c == 0, c == n_chunks - 1
        f = layers * unit.f + (ends[0] if first else 0.0) + (ends[2] if last else 0.0)
        b = layers * unit.b + (ends[1] if first else 0.0) + (ends[3] if last else 0.0)
        w = layers * unit.w if split_w else 0.0
        durations[F].append(f)
        durations[B].append(b - w)
        durations[W].append(w)
        if first or last:  # the embedding's and output layer's exposed communication
            at_end = {k: (sum(v[:2]) if first else 0.0) + (sum(v[2:]) if last else 0.0) for k, v in ends_comm.items()}
            compute.append(f + b - layers * (cf + cb) - sum(at_end.values()))
            for k, one in per_layer:
                comm_kinds[k].append(layers * one + at_end.get(k, 0.0))
        else:
            compute.append(f + b - layers * (cf + cb))
            for k, one in per_layer:
                comm_kinds[k].append(layers * one)
    return durations, compute, comm_kinds


def _overlapped_passes(layout: Layout, unit: _Unit, durations: list[list[float]], already_hidden: bool
                       ) -> list[list[float]]:
    """durations with DualPipeV's overlapped passes (planner.simulate.pipeline FO, BO) appended: a forward run
    beside another micro-batch's backward hides its expert all-to-alls under that backward's compute, and the
    backward its own under the forward's (DeepSeek-V3 report section 3.2.1; deepseek-ai/DualPipe's
    overlapped_forward_backward). Per layer that is what moe_a2a_overlap prices on every pass, so under that
    recipe option (already_hidden) the overlapped passes cost what the others do."""
    if already_hidden:
        return [*durations[:3], list(durations[F]), list(durations[B])]
    ep_f, ep_b = unit.comm_f.get("ep_comm", 0.0), unit.comm_b.get("ep_comm", 0.0)
    compute_f, compute_b = unit.f - sum(unit.comm_f.values()), unit.b - sum(unit.comm_b.values())
    hidden_f, hidden_b = ep_f - max(0.0, ep_f - compute_b), ep_b - max(0.0, ep_b - compute_f)
    layers = layout.layers_per_stage
    return [*durations[:3], [f - n * hidden_f for f, n in zip(durations[F], layers, strict=True)],
            [b - n * hidden_b for b, n in zip(durations[B], layers, strict=True)]]


def _p2p(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm,
         comm_overhead_s: float, pipe_p2p: str = "overlapped") -> list[float]:
    """Lag across each chunk boundary c -> c + 1 (activations forward, gradients back).

    "overlapped": one transfer per direction. "exchange" (Pipeline.p2p): each 1F1B
    micro-batch meets two blocking exchanges of activation and gradient (DeepSpeed's
    TrainSchedule, tests/unit/test_megatron_papers.py) and the all-gathers over tp that
    rebuild split tensors (activation at the receiver; output, and a split gradient,
    before the backward): each direction lags one exchange plus half the gathers.
    """
    size = tokens_per_micro_batch(training.seq_len, layout) * model.hidden * training.dtype_bytes
    size /= layout.tp if layout.sequence_parallel else 1
    owner = chunk_owner(layout.pp_schedule, layout.pp, layout.virtual_stages)
    split = pipe_p2p != "overlapped" and layout.tp > 1 and not layout.sequence_parallel
    part, gathers = (size / layout.tp, comm.time_s("all_gather", size, ("tp",))) if split else (size, 0.0)
    whole_grads = pipe_p2p == "exchange-whole-grads"
    times, by_pair = [], {}  # interleaved and V schedules cross the same pair of ranks at several boundaries
    for c in range(layout.pp * layout.virtual_stages - 1):
        pair = (owner[c], owner[c + 1])
        t = by_pair.get(pair)
        if t is None:
            t = comm.pair_time_s(size, ("pp",), *pair)
            if pipe_p2p != "overlapped" and t > 0:
                act = comm.pair_time_s(part, ("pp",), *pair)
                t = act + (t if whole_grads else act) + comm_overhead_s + gathers * (1.0 if whole_grads else 1.5)
            by_pair[pair] = t
        times.append(t)
    return [t + comm_overhead_s if t > 0 else 0.0 for t in times + [0.0]]


def _tail(model: ModelSpec, training: TrainingSpec, layout: Layout, comm: StepComm, cluster: Cluster,
          cal: CalibrationProfile, eng: Engine, sp: StageParams, last_backward_s: float) -> dict[str, float]:
    """Exposed work of one pipeline rank holding `sp` after its last backward: DP reduction, optimizer, gathers.

    The reductions and gathers are the tail entries of `dp_collectives` (FSDP's reduce-scatters run in the
    layers; HSDP's all-reduce of the shard across replicas is here), each priced on its groups.
    """
    g, d = DTYPE_BYTES[training.grad_dtype], training.dtype_bytes
    shard = layout.shard_ranks if layout.zero_stage >= 1 else 1
    if training.lora:  # only the adapters have gradients, optimizer states and updated weights to gather
        dense, experts = trainable_stage_params(model, training, layout, sp)
        sp = dataclasses.replace(sp, dense=dense, experts=experts)
    tail = [c for c in dp_collectives(model, training, layout, sp, eng) if c.phase == "tail"]
    reduces = [c for c in tail if c.name.endswith(("grad_reduce", "grad_replicas"))]
    reduce_bytes = sum(c.total_bytes for c in reduces)
    reduce_s = sum(collective_time_s(comm, c) for c in reduces)
    if eng.data_parallel.overlaps_backward and reduce_s > 0:
        last_bucket = reduce_s * min(1.0, DDP_BUCKET_BYTES / reduce_bytes)
        reduce_s = max(last_bucket, reduce_s - cal.comm_overlap * last_backward_s)
    gather = sum(collective_time_s(comm, c) for c in tail if c.name.endswith("param_gather"))
    if sp.experts and any(c.name == "param_gather" for c in tail):  # routed experts: their expert dp groups
        gather += comm.expert_time_s("all_gather", sp.experts * d, "edp")
    local = sp.dense / shard + sp.experts / (sp.expert_shard if layout.zero_stage >= 1 else 1)
    embedding_sync = 0.0
    if model.tie_embeddings and layout.pp > 1 and (sp.has_embedding != sp.has_output) and not training.lora:
        owner = chunk_owner(layout.pp_schedule, layout.pp, layout.virtual_stages)
        size = model.vocab * model.hidden / layout.tp * g
        embedding_sync = comm.pair_time_s(size, ("pp",), owner[0], owner[-1])
    out = {"dp_comm": reduce_s, "embedding_sync": embedding_sync, "param_gather": gather}
    out = {k: v + cal.collective_overhead_s if v > 0 else 0.0 for k, v in out.items()}
    if layout.offload == "none":
        out["optimizer"] = optimizer_time_s(local, training.optimizer, cluster.gpu, cal)
    else:  # on the host, then (optimizer offload) the updated shard back up: both between two steps
        out["optimizer"] = sum(offloaded_step_s(local, training.optimizer, layout, d, cluster))
    return out


def step_memory(model: ModelSpec, training: TrainingSpec, layout: Layout, cluster: Cluster,
                calibration: CalibrationProfile | None = None, engine: str | Engine = "meshplan") -> MemoryEstimate:
    """The memory of `layout` as a prediction reports it; the search checks fit with this same call.

    One call site for both, so the search never prunes a layout its own
    prediction calls feasible: same stage split (balanced when empty), same
    fixed overhead (the calibration's, else the memory model's default), same
    attention kernel (the engine's unless the training names one).
    """
    eng = get_engine(engine)
    cal = (calibration or load_calibration(None, cluster.gpu)).for_engine(eng.name)
    return estimate_memory(model, training, with_stage_layers(model, layout), cluster.gpu, eng, cal.other_bytes,
                           fused_attention=eng.fused_attention(training))


def simulate_step(model: ModelSpec, training: TrainingSpec, layout: Layout, cluster: Cluster,
                  calibration: CalibrationProfile | None = None, engine: str | Engine = "meshplan",
                  events: bool = False) -> StepResult:
    """Time one optimizer step of `layout` on `engine` (NAME, NAME@RELEASE or an Engine: planner.engines).

    The calibration runs at the engine's speed (`CalibrationProfile.for_engine`).
    The layout is trusted to be consistent (`planner.plan.validate`, which the
    search and plan loading apply); only the mesh size is checked here, since
    the rank groups depend on it. Fewer micro-batches than stages is allowed:
    engines run such steps, with a larger bubble.
    """
    eng = get_engine(engine)
    cal = (calibration or load_calibration(None, cluster.gpu)).for_engine(eng.name)
    layout = with_stage_layers(model, layout)
    if layout.world_size != cluster.world_size:
        raise PlanError(f"layout has {layout.world_size} ranks, cluster {cluster.name!r} {cluster.world_size} GPUs")
    peak = cluster.gpu.peak_flops(training.dtype)
    comm = StepComm(cluster, layout, cal)
    split_w = layout.pp_schedule in V_SCHEDULES
    unit = _layer_unit(model, training, layout, comm, peak, cluster, cal, eng)
    ends = _mtp_ends(model, unit, ends_s(model, training, layout, peak, cluster, cal))
    if eng.pipeline.recomputes_ends and layout.recompute == "full":  # the ends' forwards run again in the backward
        ends = (ends[0], ends[1] + ends[0], ends[2], ends[3] + ends[2])
    ends_comm = {"fsdp_comm": root_fsdp_comm_s(model, training, layout, comm, cal, ends, eng),
                 "offload_comm": root_offload_s(model, training, layout, comm, cal, ends),
                 "tp_comm": ends_tp_comm_s(model, training, layout, comm)}
    ends = tuple(e + sum(v[i] for v in ends_comm.values()) for i, e in enumerate(ends))
    durations, compute, comm_kinds = _chunk_durations(layout, unit, ends, split_w, ends_comm)
    add_grad_fold(model, training, layout, cluster, cal, eng, durations, compute)
    p2p = _p2p(model, training, layout, comm, cal.collective_overhead_s, eng.pipeline.p2p)
    n = layout.grad_accum_steps
    overlapped = layout.pp_schedule == "dualpipev"
    if overlapped:
        durations = _overlapped_passes(layout, unit, durations, training.moe_a2a_overlap)
    pipe = simulate_pipeline(layout.pp_schedule, layout.pp, layout.virtual_stages, n, durations, p2p, events)
    plain_f = durations[F]
    if cal.solo_speedup > 1.0 and layout.pp > 1:  # ranks sharing cores: a stage whose peers idle runs faster
        durations, compute, comm_kinds = solo_repriced(layout, cal.solo_speedup, n, p2p, durations[:3], compute,
                                                       comm_kinds)
        if overlapped:
            durations = _overlapped_passes(layout, unit, durations, training.moe_a2a_overlap)
        pipe = simulate_pipeline(layout.pp_schedule, layout.pp, layout.virtual_stages, n, durations, p2p, events)
    tails, seen = [], {}  # ranks holding equal parameters (one shared StageParams) with equal last backwards
    for sp, last_b in zip(pipeline_params(model, layout), pipe.last_backward_s, strict=True):
        key = (id(sp), last_b)
        if key not in seen:
            seen[key] = _tail(model, training, layout, comm, cluster, cal, eng, sp, last_b)
        tails.append(seen[key])
    finish = [pipe.rank_end_s[r] + sum(tails[r].values()) for r in range(layout.pp)]
    step = max(finish)
    r = finish.index(step)
    owner = chunk_owner(layout.pp_schedule, layout.pp, layout.virtual_stages)
    mine = [c for c in range(len(owner)) if owner[c] == r]
    breakdown = {"compute": n * sum(compute[c] for c in mine),
                 **{k: n * sum(comm_kinds[k][c] for c in mine) for k in LAYER_COMM_KEYS},
                 **tails[r]}
    if overlapped:  # what the F&B pairs hid of the expert all-to-alls the chunks' passes carry
        breakdown["ep_comm"] -= n * sum(durations[k][c] for k in (F, B, W) for c in mine) - pipe.rank_busy_s[r]
    breakdown["bubble"] = pipe.rank_end_s[r] - pipe.rank_busy_s[r]
    exposed = (*LAYER_COMM_KEYS, "dp_comm", "param_gather", "embedding_sync")
    breakdown["exposed_comm"] = sum(breakdown[k] for k in exposed)
    memory = step_memory(model, training, layout, cluster, cal, eng)
    tokens_per_s = training.tokens_per_step / step
    model_flops = model_flops_per_token(model, training) * tokens_per_s / layout.world_size
    step_events = None
    if events:
        scale = [new / old if old else 1.0 for new, old in zip(durations[F], plain_f, strict=True)]
        step_events = step_events_of(layout, pipe, (unit.comm_f, unit.comm_b), ends_comm, scale, p2p, tails)
    offload = None
    if layout.offload != "none":
        sp = pipeline_params(model, layout)[r]
        local = sp.dense / layout.shard_ranks + sp.experts / sp.expert_shard if layout.zero_stage >= 1 else sp.total
        offload = offload_summary(model, layout, cluster, training.dtype_bytes, DTYPE_BYTES[training.grad_dtype],
                                  training.optimizer, local, sp.layers, memory.host_bytes)
    ran = tuple(tuple(row) if kind != W or split_w else (0.0,) * len(row) for kind, row in enumerate(durations))
    return StepResult(step, tokens_per_s, model_flops / 1e12, model_flops / peak, breakdown, memory, r, step_events,
                      (ran, tuple(p2p)), offload)


def compute_lower_bound_s(model: ModelSpec, training: TrainingSpec, layout: Layout, cluster: Cluster,
                          calibration: CalibrationProfile | None = None) -> float:
    """A true lower bound of `simulate_step`'s step time, in a few microseconds.

    The busiest pipeline rank works at least the average: every micro-batch
    runs each layer's GEMMs 3 times (forward, input and weight gradients;
    4 with full recomputation; one fewer under LoRA) and the output layer's 3 times (2 under LoRA), each at no
    better than the calibrated peak GEMM efficiency without shape penalty.
    Attention, memory-bound work, host overhead, communication and bubbles
    only add to it.
    """
    cal = calibration or load_calibration(None, cluster.gpu)
    peak = cluster.gpu.peak_flops(training.dtype) * cal.gemm_efficiency
    if training.fp8:  # the faster of the two GEMM rates bounds the block GEMMs
        peak = max(peak, fp8_peak_flops(training.precision, cluster.gpu) * cal.fp8_gemm_efficiency)
    m = tokens_per_micro_batch(training.seq_len, layout)
    passes = 4.0 if layout.recompute == "full" else 3.0
    if training.lora:  # no weight-gradient GEMMs for the frozen base (planner.simulate.lora)
        passes -= 1.0
    layer_flops = passes * gemm_flops(layer_gemms(model, m, layout))
    output_flops = (2.0 if training.lora else 3.0) * 2.0 * m * model.vocab / layout.tp * model.hidden
    per_micro_batch = (model.n_layers * layer_flops + output_flops) / layout.pp
    solo = cal.solo_speedup if layout.pp > 1 else 1.0  # a stage whose core-sharing peers idle runs faster
    return layout.grad_accum_steps * per_micro_batch / (peak * solo)
