"""A tight, cheap lower bound of `planner.simulate.step.simulate_step`'s step time, for branch-and-bound.

`planner.simulate.step.compute_lower_bound_s` (GEMM FLOPs at peak GEMM efficiency) is the
same for almost every layout of a search, so it cannot order or prune them.
This bound keeps what separates layouts and is still never above the
simulated time: it follows the simulator's recipe (planner/simulate/step.py) term
by term, taking every piece at or below what the simulator charges.

Per layer and micro-batch, with f, b the GPU compute of
`planner.simulate.compute.layer_times` (x + max(0, c - x) = max(x, c)):
    F >= max( max(f, all-gather) + 2 TP points,                  host time of the forward )
    B >= max( max(b, all-gather + reduce-scatter) + TP exposed,   host time of the backward )
    TP exposed = max(0, 2 TP points - weight-gradient GEMMs if the engine overlaps them, else 0)
                 + 2 TP points of the recomputed forward under full recomputation
since the simulator combines GPU and host time with a p-norm, which is at
least their max. The FSDP collectives count only under ZeRO-2/3 (the
all-gather only under ZeRO-3), and host time is the layer overhead (1 forward, 2 backward,
3 with full recomputation), without any per-collective dispatch cost. Collectives are priced
on the first group of their axes (the simulator takes the worst group, which
includes it) with the same collective model, leaving out any per-call
overhead the simulator may add.

Per pipeline rank r, holding chunks whose lowest is chunk r, n micro-batches:
    start_r  >= F of every layer below chunk r (micro-batch 0 must get there)
    end_r    >= start_r + n (F_r + B_r)            (all its operations)
    finish_r >= max(end_r + last DDP bucket, start_r + n F_r + (n-1) B_r + reduce)
                + parameter all-gather (ZeRO-1/2) + optimizer step
where the max is the simulator's overlap of the gradient reduction with the
last micro-batch's backward (without overlap, end_r + reduce). Under GPipe,
1F1B and interleaved 1F1B (whose Megatron order ends every rank on its lowest
chunk, the last group's backwards running chunk by chunk downwards) the last
operation of rank r is the backward of chunk r for the last micro-batch,
which must still travel back through every chunk below it to rank 0. Ranks
with the same work differ only in start_r, so one rank per kind is enough.

MoE: the expert all-to-alls (and etp gathers) of a micro-batch of one
sequence are added to every layer pass: exposed in the simulated step too,
and never shorter at a larger micro-batch (except under DualPipeV, whose
overlapped passes hide them: left out there). Routed experts' gradients are
reduced (and under ZeRO-1/2 gathered) over the expert data-parallel groups,
priced as the simulator prices them.

Left out, so the bound stays one whatever they cost: p2p transfers, CP
exchanges, the embedding sync, and every idle wait beyond the chains above.
`tests/test_search.py` checks bound <= simulated step on sampled layouts of
every schedule, ZeRO stage and engine, and that branch-and-bound finds what
exhaustive simulation finds. Change this file with planner/simulate/step.py.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from planner.engines import DDP_BUCKET_BYTES, Engine, get_engine
from planner.layout import (
    MESH_AXES,
    Layout,
    balanced_layers,
    rank_chunks,
    recompute_fields,
    recomputed_fraction,
    recomputed_share,
    zero_axes,
)
from planner.memory.params import StageParams, layer_params_split, pipeline_params
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.comm import StepComm, expert_comm_s, expert_grid_key, expert_groups_key, group_offsets
from planner.simulate.compute import (
    COMPILE_HOST_FACTOR,
    embedding_times,
    fp8_cast_bytes,
    fp8_peak_flops,
    layer_times,
    optimizer_time_s,
    output_times,
    tokens_per_micro_batch,
)
from planner.simulate.host import layer_host_scale
from planner.simulate.lora import frozen_end, lora_layer_times, trainable_layer_params
from planner.simulate.recompute import recomputed_comm
from planner.training import DTYPE_BYTES, TrainingSpec
from topologies.cluster import Cluster

# schedules whose last operation on rank r is chunk r's backward of the last micro-batch (module docstring)
CHAIN_BACK_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# schedules whose passes may run beside another micro-batch's and hide their expert all-to-alls there
# (planner.simulate.pipeline's FO and BO): their bound leaves the expert communication out
OVERLAPPED_SCHEDULES = ("dualpipev",)


@lru_cache(maxsize=4096)
def rank_structure(n_layers: int, pp: int, v: int, schedule: str, layers_per_stage: tuple[int, ...]
                   ) -> tuple[tuple[int, int, bool, bool, bool, int], ...]:
    """One entry per kind of pipeline rank: (layers held, layers below its lowest chunk, holds the embedding,
    holds the output, lowest chunk > 0, a rank of that kind); of ranks with the same work, the one furthest down.

    Ranks with the same layers and ends hold the same parameters (`planner.memory.params`), so they differ
    only in how far down the pipeline they start.
    """
    layers = layers_per_stage or balanced_layers(n_layers, pp * v)
    below = [0]
    for count in layers:
        below.append(below[-1] + count)
    kinds: dict[tuple, tuple] = {}
    for r in range(pp):
        chunks = rank_chunks(schedule, pp, v, r)
        low = min(chunks)
        work = (sum(layers[c] for c in chunks), 0 in chunks, pp * v - 1 in chunks, low > 0)
        if work not in kinds or below[low] > kinds[work][1]:
            kinds[work] = (work[0], below[low], *work[1:], r)
    return tuple(kinds.values())


@lru_cache(maxsize=16384)
def _axes_key(shape_key: tuple[int, ...], axes: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """(size, stride) of each of `axes` in the mesh: what the group of rank 0 along them depends on."""
    strides, step = {}, 1
    for axis, size in zip(reversed(MESH_AXES), reversed(shape_key), strict=True):
        strides[axis] = (size, step)
        step *= size
    return tuple(strides[axis] for axis in MESH_AXES if axis in axes)


def rank_kinds(model: ModelSpec, layout: Layout) -> tuple[tuple[int, int, bool, bool, bool, StageParams], ...]:
    """`rank_structure` with each kind's parameters instead of its representative rank.

    A dense model's parameters per rank do not depend on dp_shard or cp (they only
    shard experts), so those are priced on one canonical layout per pipeline and tp.
    """
    if model.moe is None:
        layout = Layout(tp=layout.tp, pp=layout.pp, pp_schedule=layout.pp_schedule,
                        virtual_stages=layout.virtual_stages, layers_per_stage=layout.layers_per_stage)
    params = pipeline_params(model, layout)
    return tuple((*kind[:5], params[kind[5]]) for kind in rank_structure(
        model.n_layers, layout.pp, layout.virtual_stages, layout.pp_schedule, layout.layers_per_stage))


class StepBound:
    """Lower bounds of the step time for the layouts of one search (one model, cluster, profile, engine).

    `for_shape` does the work that does not depend on the micro-batch or the
    recomputation once per shape; `ShapeBound.seconds` then costs a few
    dictionary look-ups per candidate.
    """

    def __init__(self, model: ModelSpec, cluster: Cluster, calibration: CalibrationProfile, engine: str | Engine,
                 recompute_modules: tuple[str, ...] = ()) -> None:
        # Price the bound at the engine's speed, as simulate_step does; a faster
        # base profile would stay a valid bound but prune far less.
        self.engine = get_engine(engine)
        self.model, self.cluster, self.cal = model, cluster, calibration.for_engine(self.engine.name)
        self.recompute_modules = recompute_modules  # the search's --recompute-modules, on its selective level
        self.overlap_dp = self.engine.data_parallel.overlaps_backward
        self.collectives = StepComm(cluster, Layout(), self.cal).model
        self._units: dict[tuple, tuple[float, float, float, float]] = {}
        self._ends: dict[tuple, tuple[float, float, float, float]] = {}
        self._kinds: dict[tuple, tuple] = {}
        self._chains: dict[tuple, tuple] = {}  # per pipeline: rank kinds with their tails at 0 (relaxed)
        self._tails: dict[tuple, tuple] = {}  # per mesh, ZeRO and pipeline: rank kinds with their tails
        self._times: dict[tuple, float | tuple[float, float]] = {}
        self._group_shapes: dict[tuple, object] = {}  # _axes_key -> the CollectiveModel's GroupShape of that group

    def seconds(self, layout: Layout, training: TrainingSpec) -> float:
        """Never above simulate_step(...).step_time_s for this layout (see the module doc)."""
        return self.for_shape(layout, training).seconds(
            layout.micro_batch_size, (layout.recompute, layout.recompute_layers, layout.recompute_modules))

    def for_shape(self, shape: Layout, training: TrainingSpec) -> ShapeBound:
        """The micro-batch-independent part of the bound of `shape` (its micro-batch and recompute are ignored)."""
        shape_key = shape.mesh_shape
        key = (shape_key, shape.zero_stage, shape.ep, shape.etp, shape.pp_schedule, shape.virtual_stages,
               shape.layers_per_stage, training.dtype, training.grad_dtype, training.optimizer, training.precision,
               training.finetune)
        kinds = self._tails.get(key)
        if kinds is None:
            kinds = self._tails[key] = tuple((held, below, emb, out, low, *self._tail(shape, shape_key, training, sp))
                                             for held, below, emb, out, low, sp in self._rank_kinds(shape))
        expert_s = 0.0 if shape.pp_schedule in OVERLAPPED_SCHEDULES else self.expert(shape_key, shape.ep, shape.etp,
                                                                                       training)
        return ShapeBound(self, shape, training, self.fsdp(shape.zero_stage, shape.ep, shape.etp, shape_key, training),
                          kinds, expert_s)

    def relaxed(self, units: tuple[float, float, float, float], fsdp: tuple[float, float], expert_s: float,
                host_scale: tuple[float, float], training: TrainingSpec, micro_batch_size: int,
                recompute: tuple[str, int], pipeline: tuple[int, str, int], tp: int, cp: int, per_replica: int,
                maximum: Callable = max) -> float:
        """`ShapeBound.seconds` with every rank's tail (gradient reduction, gathers, optimizer) at 0.

        Given terms at or below those of a set of shapes with this pipeline (pp, schedule, virtual
        stages), tp, cp and micro-batch count, it is never above the bound of any of them: every
        step of the chain is a sum or max of non-negative terms, and floating-point rounding of
        sums and maxima is monotone. The search bounds a group of shapes with it before it builds them.
        With numpy arrays of terms and maximum=np.maximum it bounds many shapes at once, with the same
        operations in the same order, hence the same values.
        """
        pp, schedule, v = pipeline
        kinds = self._chains.get(pipeline)
        if kinds is None:
            kinds = self._chains[pipeline] = tuple((*kind[:5], 0.0, 0.0, 0.0) for kind in rank_structure(
                self.model.n_layers, pp, v, schedule, ()))
        f_layer, b_layer = self._layers(units, fsdp, expert_s, host_scale, training, recompute, pp * v, maximum)
        ends = self._ends.get((training.seq_len, training.dtype, micro_batch_size, tp, cp)) or \
            self.end_times(Layout.trusted(tp=tp, cp=cp), training, micro_batch_size)  # they read tp and cp only
        best = chain_seconds(f_layer, b_layer, ends, per_replica // micro_batch_size, kinds, self.overlap_dp,
                             schedule in CHAIN_BACK_SCHEDULES, maximum)
        return self._solo(best, pp)

    def _solo(self, seconds, pp: int):
        """CPU ranks sharing cores: a stage whose peers idle runs up to solo_speedup faster (planner.simulate.host)."""
        return seconds / self.cal.solo_speedup if pp > 1 else seconds

    def _layers(self, units: tuple[float, float, float, float], fsdp: tuple[float, float], expert_s: float,
                host_scale: tuple[float, float], training: TrainingSpec, recompute: str | tuple[str, int],
                stages: int, maximum: Callable = max) -> tuple[float, float]:
        """(F, B) of one layer and micro-batch (module docstring); numpy arrays of terms with maximum=np.maximum."""
        f, b, tp_f, tp_b = units
        if training.async_tp:  # TP collectives may hide under their GEMMs (planner.simulate.tp_overlap)
            tp_f = tp_b = 0.0
        ag, ag_rs = fsdp
        host = self.cal.layer_overhead_s * (COMPILE_HOST_FACTOR if training.compile else 1.0)
        f_layer = maximum(maximum(f, ag) + tp_f + expert_s, host * host_scale[0])
        kind, n = recompute_level(recompute)
        share = recomputed_share(kind, n, self.model.n_layers, stages)
        b_layer = maximum(maximum(b, ag_rs) + tp_b + expert_s, host * (host_scale[1] + share * host_scale[0]))
        return f_layer, b_layer

    def host_scale(self, shape: Layout, training: TrainingSpec) -> tuple[float, float]:
        """The simulator's eager host time per layer pass over layer_overhead_s
        (planner.simulate.host.layer_host_scale), cached on what it reads."""
        key = ("host", shape.ep, shape.recompute, training.attention, training.cuda_graphs, training.moe_grouped_gemm,
               training.moe_router_fusion, training.moe_router_graphs)
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = layer_host_scale(self.model, training, shape,
                                                      self.engine.fused_attention(training))
        return hit

    def expert(self, shape_key: tuple[int, ...], ep: int, etp: int, training: TrainingSpec) -> float:
        """Expert communication of one layer pass at micro-batch 1 (module docstring) on mesh `shape_key`;
        none under moe_a2a_overlap, where another micro-batch's compute can hide all of it."""
        if self.model.moe is None or ep * etp == 1 or training.moe_a2a_overlap:
            return 0.0
        # the all-to-alls and etp collectives run on the "ep" and "etp" groups only: meshes with the same
        # expert grid key, cp and tp price the same
        key = ("expert", expert_grid_key(shape_key, ep, etp, self.cluster.gpus_per_node), shape_key[3], shape_key[4],
               training.seq_len, training.dtype_bytes)
        hit = self._times.get(key)
        if hit is None:
            one = self._expert_layout(shape_key, ep, etp)  # micro-batch 1
            act = tokens_per_micro_batch(training.seq_len, one) * self.model.hidden * training.dtype_bytes
            hit = self._times[key] = expert_comm_s(self.model, one, self._expert_comm(shape_key, ep, etp), act)[0]
        return hit

    @staticmethod
    def _expert_layout(shape_key: tuple[int, ...], ep: int, etp: int) -> Layout:
        """A layout of mesh `shape_key` with this expert grid (what StepComm and expert_comm_s read)."""
        pp, replicate, shard, cp, tp = shape_key
        return Layout.trusted(tp=tp, pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, ep=ep, etp=etp,
                              zero_stage=1 if shard > 1 else 0)

    def _expert_comm(self, shape_key: tuple[int, ...], ep: int, etp: int) -> StepComm:
        """A StepComm for the expert grid of mesh `shape_key` (only the mesh, ep and etp matter), cached."""
        key = ("comm", shape_key, ep, etp)
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = StepComm(self.cluster, self._expert_layout(shape_key, ep, etp), self.cal)
        return hit

    def _edp_time(self, op: str, size_bytes: float, shape_key: tuple[int, ...], ep: int, etp: int) -> float:
        """StepComm.expert_time_s over the "edp" groups, cached on what they depend on (`expert_groups_key`), so
        that meshes with the same groups neither build a StepComm nor look the groups up again."""
        key = ("edp", op, size_bytes, expert_groups_key(shape_key, ep, etp, "edp", self.cluster.gpus_per_node))
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = self._expert_comm(shape_key, ep, etp).expert_time_s(op, size_bytes, "edp")
        return hit

    # ---- cached pieces -------------------------------------------------------

    def _rank_kinds(self, layout: Layout) -> tuple:
        """`rank_kinds`, cached by what decides the counts (pipeline_params' inputs but the expert ZeRO group, which
        StageParams only records: `_tail` takes it from the layout)."""
        key = (layout.pp, layout.virtual_stages, layout.pp_schedule, layout.layers_per_stage, layout.tp, layout.ep,
               layout.etp)
        hit = self._kinds.get(key)
        if hit is None:
            hit = self._kinds[key] = rank_kinds(self.model, layout)
        return hit

    def _time(self, op: str, size_bytes: float, shape_key: tuple[int, ...], axes: tuple[str, ...]) -> float:
        """`op` on the group of rank 0 along `axes`, cached here: a DP group of thousands of ranks is slow to hash.

        That group is the sums of k * stride over the axes (`group_offsets`), so it is keyed by the axes' sizes
        and strides: meshes that differ elsewhere share the price.
        """
        axes_key = _axes_key(shape_key, axes)
        key = (op, size_bytes, axes_key)
        hit = self._times.get(key)
        if hit is None:
            shape = self._group_shapes.get(axes_key)  # the group, reduced to what its price depends on, once
            if shape is None:
                group = group_offsets(shape_key, axes)
                shape = self._group_shapes[axes_key] = self.collectives.group_shape(group) if len(group) > 1 else None
            hit = self._times[key] = 0.0 if size_bytes <= 0 or shape is None else \
                self.collectives.shape_time_s(op, size_bytes, shape) * self.cal.collective_scale.get(op, 1.0)
        return hit

    def unit(self, shape: Layout, training: TrainingSpec, micro_batch_size: int, recompute: str | tuple[str, int]
             ) -> tuple[float, float, float, float]:
        """(GPU forward, GPU backward, TP time in F, TP time in B) of one layer and micro-batch.

        recompute: a kind, or (kind, recompute_layers) for partial full recomputation, or (kind,
        recompute_layers, recompute_modules); else the search's recompute_modules ride on "selective".
        """
        kind, n = recompute_level(recompute)
        modules = recompute[2] if isinstance(recompute, tuple) and len(recompute) > 2 else self.recompute_modules
        key = (training.seq_len, training.dtype, training.precision, training.attention, training.compile,
               training.finetune, training.lora_rank, training.lora_targets, micro_batch_size, shape.tp, shape.cp, shape.sequence_parallel, kind, n, modules,
               shape.pp * shape.virtual_stages if n else 0, shape.ep, shape.etp)
        hit = self._units.get(key)
        if hit is None:
            layout = shape.trusted_replace(micro_batch_size=micro_batch_size,
                                           **recompute_fields(kind, n, modules))
            gpu, cal = self.cluster.gpu, self.cal
            peak = gpu.peak_flops(training.dtype)
            lt = layer_times(self.model, training.seq_len, training.dtype_bytes, layout, gpu, peak, cal,
                             self.engine.fused_attention(training),
                             fp8_peak=fp8_peak_flops(training.precision, gpu), compile=training.compile,
                             cast_bytes=fp8_cast_bytes(training.precision, gpu))
            lt = lora_layer_times(self.model, training, layout, gpu, peak, cal, lt)
            point = 0.0
            if layout.tp > 1:
                act = tokens_per_micro_batch(training.seq_len, layout) * self.model.hidden * training.dtype_bytes
                point = StepComm(self.cluster, Layout.trusted(tp=layout.tp), cal).tp_point_s(act, layout.sequence_parallel)
            hidden = lt.backward_weight_s if self.engine.tensor_parallel.backward_overlap else 0.0
            recomputed = point * (2 * recomputed_fraction(layout, self.model.n_layers)
                                  + recomputed_comm(self.model, layout)[0])
            hit = self._units[key] = (lt.forward_s, lt.backward_s, 2 * point,
                                      recomputed + max(0.0, 2 * point - hidden))
        return hit

    def fsdp(self, zero_stage: int, ep: int, etp: int, shape_key: tuple[int, ...],
             training: TrainingSpec) -> tuple[float, float]:
        """(all-gather, reduce-scatter) of one layer's parameters in (forward, backward) under ZeRO-2/3, over dp_shard x cp
        of mesh `shape_key` (Layout.shard_axes)."""
        dp_shard, cp = shape_key[2], shape_key[3]
        if zero_stage < 2 or dp_shard * cp == 1:
            return 0.0, 0.0
        shard_axes = zero_axes(cp)
        # it reads tp, the ZeRO group (dp_shard x cp: its size and stride) and the expert grid of the mesh: meshes
        # that differ only in pp or dp_replicate share it
        gathered = 1 if training.fp8 else training.dtype_bytes  # float8 all-gathers: never more than this
        key = ("fsdp", zero_stage, dp_shard, ep, etp, shape_key[3], shape_key[4], training.grad_dtype, gathered,
               training.finetune, training.lora_rank, training.lora_targets)
        hit = self._times.get(key)
        if hit is None:
            dense, experts = layer_params_split(self.model, shape_key[4], ep, etp)
            unit = dense + experts
            if training.lora:  # only the adapters' gradients are reduce-scattered (planner.simulate.lora)
                unit_grads = sum(trainable_layer_params(self.model, training, Layout.trusted(tp=shape_key[4])))
            else:
                unit_grads = unit
            rs = self._time("reduce_scatter", unit_grads * DTYPE_BYTES[training.grad_dtype], shape_key, shard_axes)
            ag = self._time("all_gather", unit * gathered, shape_key, shard_axes) \
                if zero_stage == 3 else 0.0
            # FSDP2 keeps each part's last block gathered from its forward into its backward
            # (planner.simulate.collectives.block_gathers_per_layer): bound the backward's gathers by none
            hit = self._times[key] = (ag, rs)
        return hit

    def _tail(self, shape: Layout, shape_key: tuple[int, ...], training: TrainingSpec, sp: StageParams
              ) -> tuple[float, float, float]:
        """(gradient reduction, its last DDP bucket, parameter all-gather + optimizer) of one rank."""
        g, d = DTYPE_BYTES[training.grad_dtype], training.dtype_bytes
        if training.lora:  # the adapters' reduction, gathers and update: small, bounded below by nothing
            return 0.0, 0.0, 0.0
        experts = sp.experts > 0
        if shape.zero_stage <= 1:  # routed experts reduce over their expert data-parallel groups
            reduce_bytes = sp.total * g
            reduce_s = self._time("all_reduce", sp.dense * g, shape_key, shape.grad_axes)
            if experts:
                reduce_s += self._edp_time("all_reduce", sp.experts * g, shape_key, shape.ep, shape.etp)
        else:
            reduce_bytes = sp.total * g / shape.shard_ranks
            reduce_s = self._time("all_reduce", reduce_bytes, shape_key, ("dp_replicate",))
        last_bucket = reduce_s * min(1.0, DDP_BUCKET_BYTES / reduce_bytes) if reduce_s > 0 else 0.0
        gather = 0.0
        # ZeRO-1, and ZeRO-2 outside FSDP2 (which gathers per micro-batch, hidden up to comm_overlap: not bounded)
        if shape.zero_stage == 1 or (shape.zero_stage == 2 and self.engine.dp_path(shape) != "fsdp"):
            gather = self._time("all_gather", sp.dense * d, shape_key, shape.shard_axes)
            if experts:
                gather += self._edp_time("all_gather", sp.experts * d, shape_key, shape.ep, shape.etp)
        shard = shape.shard_ranks if shape.zero_stage >= 1 else 1
        local = sp.dense / shard + sp.experts / (shape.expert_dp_shard if shape.zero_stage >= 1 else 1)
        return reduce_s, last_bucket, gather + optimizer_time_s(local, training.optimizer, self.cluster.gpu, self.cal)

    def end_times(self, shape: Layout, training: TrainingSpec, micro_batch_size: int
                  ) -> tuple[float, float, float, float]:
        """(embedding F, B, output F, B) for one micro-batch, GPU vs host time."""
        key = (training.seq_len, training.dtype, micro_batch_size, shape.tp, shape.cp, training.finetune)
        hit = self._ends.get(key)
        if hit is None:
            layout = shape.trusted_replace(micro_batch_size=micro_batch_size)
            gpu, cal, s = self.cluster.gpu, self.cal, training.seq_len
            peak = gpu.peak_flops(training.dtype)
            emb = frozen_end(training, embedding_times(self.model, s, training.dtype_bytes, layout, gpu, cal))
            out = frozen_end(training, output_times(self.model, s, layout, gpu, peak, cal))
            host = cal.layer_overhead_s
            hit = self._ends[key] = (max(emb.forward_s, host), max(emb.backward_s, host),
                                     max(out.forward_s, host), max(out.backward_s, 2 * host))
        return hit


def recompute_level(recompute: str | tuple[str, int]) -> tuple[str, int]:
    """(kind, recompute_layers) of a search level: a kind alone recomputes every layer it names."""
    return (recompute, 0) if isinstance(recompute, str) else (recompute[0], recompute[1])


class ShapeBound:
    """The bound of one shape for any micro-batch and recomputation (see StepBound.for_shape)."""

    def __init__(self, parent: StepBound, shape: Layout, training: TrainingSpec, fsdp: tuple[float, float],
                 kinds: tuple[tuple, ...], expert_s: float = 0.0) -> None:
        self.parent, self.shape, self.training = parent, shape, training
        self.expert_s = expert_s
        self.fsdp, self.kinds = fsdp, kinds
        self.per_replica = training.global_batch_size // shape.dp
        self.chain_back = shape.pp_schedule in CHAIN_BACK_SCHEDULES
        self.host_scale = parent.host_scale(shape, training)

    def seconds(self, micro_batch_size: int, recompute: str | tuple[str, int]) -> float:
        """Never above the simulated step time of the shape with this micro-batch and recomputation."""
        p = self.parent
        f_layer, b_layer = p._layers(p.unit(self.shape, self.training, micro_batch_size, recompute), self.fsdp,
                                     self.expert_s, self.host_scale, self.training, recompute,
                                     self.shape.pp * self.shape.virtual_stages)
        best = chain_seconds(f_layer, b_layer, p.end_times(self.shape, self.training, micro_batch_size),
                             self.per_replica // micro_batch_size, self.kinds, p.overlap_dp, self.chain_back)
        return p._solo(best, self.shape.pp)


def chain_seconds(f_layer: float, b_layer: float, ends: tuple[float, float, float, float], n: int,
                  kinds: tuple[tuple, ...], overlap: bool, chain_back: bool, maximum: Callable = max) -> float:
    """The pipeline chains of the module docstring: F and B of a layer, the embedding/output ends, n micro-batches.

    F and B may be numpy arrays (one entry per shape) with maximum=np.maximum.
    """
    ef, eb, of, ob = ends
    best = chain_end = rank0_tail = 0.0
    for held, below, emb, out, low, reduce_s, last_bucket_s, after_s in kinds:
        fr = held * f_layer + (ef if emb else 0.0) + (of if out else 0.0)
        br = held * b_layer + (eb if emb else 0.0) + (ob if out else 0.0)
        start = below * f_layer + (ef if low else 0.0)
        end = start + n * (fr + br)
        if overlap:
            finish = maximum(end + last_bucket_s, start + n * fr + (n - 1) * br + reduce_s)
        else:
            finish = end + reduce_s
        best = maximum(best, finish + after_s)
        if low:
            chain_end = maximum(chain_end, end + below * b_layer + eb)
        else:
            rank0_tail = after_s + (last_bucket_s if overlap else reduce_s)
    if chain_back:  # the backward chain ends on rank 0, then its tail
        best = maximum(best, chain_end + rank0_tail)
    return best
