"""Memory model: bytes per GPU for any layout, by category, with an engine's precision recipe.

`estimate_memory` returns, for every pipeline stage, the bytes one rank of
that stage holds at its peak, split into the plan.json categories
(params, grads, optimizer, activations, comm_buffers, other), and picks the
worst stage. The peak is the largest of the phases of a training step
(planner.memory.phases: what coexists at the loss backward, the output
layer's backward, a block's backward, the end of the backward and the
optimizer step), not the sum of each category's own maximum; the breakdown
is the one at that phase (`peak_phase`). Ranks of one stage are symmetric
(TP, CP and DP peers hold the same amounts; under meshplan's ZeRO-1 the most
loaded rank is taken), so the worst stage is the worst rank. Pure
arithmetic: the search calls it for thousands of candidates.

Model states (P = parameters a rank holds, N = dp_shard, the ZeRO group;
dp_replicate replicas hold full copies of what dp_shard shards, i.e. HSDP):

  engine     dtype   params         grads    optimizer
  meshplan   any     4/N' + bufs    4/N2     M/N1          (the fp32 parameters are the master)
  megatron   bf16    2/N3           4/N2     (4 + M)/N1    (fp32 master + moments)
  deepspeed  bf16    2/N3           2/N2     (4 + M)/N1    (K = 12 with AdamW)
  megatron, deepspeed  fp32  4/N3   4/N2     M/N1          (no master copy)

M = 8 for AdamW (two fp32 moments), 4 for SGD with momentum. N1 = N when
zero_stage >= 1, N2 when >= 2, N3 when == 3, else 1; N' = N when >= 2.
meshplan's ZeRO-1 is torch's ZeroRedundancyOptimizer, which gives whole
tensors to ranks (largest first, to the least loaded): the worst rank's
optimizer state is M x `memory_params.zero1_rank_params`, e.g. a tied 128k x
2048 embedding alone (2.0 GiB) rather than M P / N. bufs: the executor's
fp32 RoPE tables, cos and sin of max_seq_len x head_dim (2 * S * d * 4 B,
module buffers, counted in params on every stage).

Compute copy (meshplan, `ModelStates.compute_copy`, in params, alive from the
forward to the backward), by how the executor syncs gradients (`dp_path`,
executor.parallel.parallelize._dp_kind) with D the compute-dtype bytes:
  none, ddp   (dp = 1, or ZeRO-0/1 without TP and PP: torch DDP) fp32
              parameters under torch.autocast, whose D-byte weight copies are
              saved for the backward: D x (P - uncast), the embedding table
              (unless it is the tied head) and norms are never cast; under
              full recomputation only the output layer's copy (D x head) is
              kept, the blocks cast again when recomputed; 0 in fp32
  replicate   (ZeRO-0/1 with TP or PP: FSDP2's replicate with
              MixedPrecisionPolicy(param_dtype=bf16)): D x P; 0 in fp32
  fsdp        ZeRO-2 (reshard_after_forward=False): every unit's unsharded
              copy, D x P (4 B in fp32); ZeRO-3: none, the gathered units are
              transient comm_buffers, except under PP, where
              torch.distributed.pipelining turns off resharding after the
              backward between micro-batches (D x P); under float8 with
              FSDP float8 all-gathers the blocks' linears are kept as the
              gathered 1-byte data (torchao's fsdp_post_all_gather)
The usual mixed-precision table (model 4+2, optimizer 8, grads 2+, total
16+ bytes per parameter; Rajbhandari et al. 2020, sec. 3.1, count 2+2+12) is
meshplan's single-GPU row: 4 + ~2 + 8 + 4.

megatron: bf16 parameters, fp32 main gradients, fp32 master weights in the
optimizer with the two Adam moments: 2 + 4 + 12 = 18 bytes per parameter; its
distributed optimizer is ZeRO-1 (shards the 12). Under fp8/mxfp8 the block
linears add Transformer Engine's cached 8-bit copies (1 B, 2 B with Hopper's
transpose, 2 x 1.03 B under MXFP8: Fp8Recipe.weight_bytes), or with 8-bit
parameters (TrainingSpec.fp8_params) hold those instead of the 2 B; Megatron
FSDP then shards and gathers their row-wise bytes (planner.engines.TE_FP8). deepspeed: the ZeRO paper's
2 + 2 + K, K = 12 (Rajbhandari et al. 2020, fig. 1): stage 1 shards K, 2 also
the gradients, 3 also the parameters.

Which parameters a rank holds (`stage_params`): TP splits every attention and
MLP matrix, the column-parallel biases and the vocabulary of the embedding
and output layers by t (a tied matrix only where the engine splits it:
TensorParallel.splits_tied_vocab in planner.memory.params); norms, row-parallel biases, learned positions and the
MoE router are replicated on every TP rank (sequence parallel shards norm
activations, not norm weights). PP gives rank r its chunks (chunk r; with
interleaving r, r + pp, ...; with zb-v r and 2pp - 1 - r) and their layers,
the embedding to the holder of chunk 0, the final norm and output layer to the
holder of the last chunk; with tied embeddings and those on different ranks,
both hold a copy. EP splits the routed experts by ep (and by t); their ZeRO
group is min(dp_shard, dp_shard * cp / ep), the ranks that hold the same experts
(meshplan's executor keeps MoE layers whole over tp and shards its experts over
dp_shard * cp / ep only under FSDP2: planner.memory.states).

Offload: "optimizer" moves the optimizer states to host memory (and with them
AdamW's step temporaries); "optimizer+params" also the parameter storage and,
when sharded (ZeRO >= 2), the gradients; the GPU then still needs the
compute-dtype parameters it multiplies with (ZeRO < 3: the whole stage, in
params; ZeRO-3: the gathered units, in comm_buffers). `host_bytes` reports
what moved.

comm_buffers (D compute-dtype bytes, G grad_dtype bytes, P the stage's
parameters; when each exists: planner.memory.phases):
  classic DDP    meshplan's ddp path: torch DDP with its default
                 gradient_as_bucket_view=False keeps bucket copies of every
                 gradient for its lifetime: G * P (the ddp path of Engine.dp_path:
                 meshplan's executor, torchtitan's DDP through 2026-02)
  FSDP2          a block's D-byte unsharded gradient and its G-byte
                 reduce-scatter input; the root unit (embedding + final norm +
                 output, fully_shard(part)) holds the output layer's D-byte
                 gradient until its own reduction at the very end; ZeRO-3
                 gathers D * (root + in-use block + prefetched block)
  other engines  ZeRO-0/1: one 25 MiB bucket; ZeRO-2/3: (D + G) * block, and
                 ZeRO-3 D * (max(root, block) + 2 blocks)
  TP + SP        all-gather output and reduce-scatter input: 2*s*b*h*D / cp
                 (megatron, deepspeed; PyTorch's SP saves the gathered tensors,
                 counted as activations: TensorParallel.saves_gathered_inputs)
  PP             activation send + gradient receive: 2*s*b*h*D / cp (/t with SP); for
                 meshplan (torch.distributed.pipelining), activations instead: each
                 in-flight micro-batch's stage output kept for its backward and the
                 received output gradient, (in-flight + 1) * s*b*h*B / cp on a
                 non-last stage, B = 4 under autocast (the fp32 residual stream)
  CP             ring (Transformer Engine's p2p): the K/V chunk sent and the one
                 received, 2 * 2*s*b*k*d*D / (cp*t); all-gather (torch's
                 context_parallel by default, meshplan's executor:
                 ContextParallel.gathers_kv): the whole sequence's K/V, or in
                 the backward its gradient before the reduce-scatter,
                 2*s*b*k*d*D / t; torchtitan repeats the K/V heads to the
                 a query heads before SDPA (its Attention's repeat_kv), so the
                 gather carries a heads, not k (ModelCode.repeats_kv, to 2026-01).
                 Phased engines count it in the block phases only: it lives
                 while a block's attention runs, not at the loss backward
  EP             all-to-all dispatch and combine: 2 * top_k*s*b*h*D / cp; none for
                 meshplan, whose functional all-to-all outputs are the experts'
                 saved inputs and outputs (Experts.executor_experts)
other: CUDA context, NCCL communicator buffers and allocator slack:
DEFAULT_OTHER_BYTES per GPU kind unless the caller (a calibration profile)
passes other_bytes; plus, for the PyTorch engines (meshplan, torchtitan), the
caching allocator's reserve beyond the tensors (planner.memory.reserved: one
pool per CUDA stream, the loss's hole), the same in every phase. So
`allocated_bytes` (tensors: torch.cuda.max_memory_allocated) <=
`reserved_bytes` (torch.cuda.max_memory_reserved, what torchtitan reports)
<= `peak_bytes` (what must fit the GPU); megatron and deepspeed keep the
papers' accounting, their allocator slack inside the fixed `other`.

Activations: see planner.memory.activations (Korthikanti et al. 2022).
Activation offload (Layout.activation_offload_layers = N, Megatron-Core's
cpu_offloading_num_layers through Transformer Engine's CPU offload context):
the kept activations of N layers per model chunk wait in host memory from
their forward to their backward, so the GPU holds the stage's other layers'
(at least one layer's: the one whose backward runs first); `host_bytes`
counts what moved. Megatron-Core offloads activations only without pipeline
parallelism (TransformerConfig refuses cpu_offloading with pp > 1). The step
simulator does not price the copies: they run on their own stream beside the
next layer's compute, which hides them on NVLink-C2C hosts (GB200/GB300, the
published offload rows); over PCIe a large layer's copy can outlast it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from planner.engines import Engine, fp8_rowwise_bytes, get_engine
from planner.layout import V_SCHEDULES, Layout, recomputed_fraction, selective_modules
from planner.memory.activations import (
    FP32_BYTES,
    embedding_dropout_bytes,
    layer_activation_bytes,
    layer_activation_terms,
    layer_backward_transient,
    op_saved_terms,
    output_activation_bytes,
)
from planner.memory.boundary import boundary_buffers
from planner.memory.in_flight import first_stage_alive, in_flight_per_rank, output_in_flight
from planner.memory.lora import lora_activation_terms
from planner.memory.params import StageParams, pipeline_params
from planner.memory.phases import (
    Activations,
    Phase,
    StageBytes,
    on_gpu_layers,
    peak_phase,
    published_phase,
    published_stage_bytes,
    step_phases,
    torch_stage_bytes,
)
from planner.memory.reserved import reserve_bytes
from planner.memory.states import stage_states
from planner.model.spec import ModelSpec
from planner.plan import MEMORY_CATEGORIES
from planner.training import TrainingSpec
from topologies.hardware import GIB, GPUSpec

# CUDA context with lazy module loading (~0.5 GiB), NCCL communicator buffers
# (~0.5 GiB over a handful of groups) and allocator fragmentation (~0.5 GiB):
# what nvidia-smi shows beyond torch.cuda.max_memory_allocated on a training
# job. The CPU stand-in has none of these. Calibration replaces the number.
DEFAULT_OTHER_BYTES = {"gpu": 3 * GIB // 2, "cpu": 0}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category at the peak phase: the worst rank's breakdown and every stage's.

    The category dictionaries are made on first access from the stored
    per-stage inputs, so the search, which reads only peak_bytes, does not
    pay for them.
    """

    peak_bytes: int  # the worst rank at its peak phase, `other` included
    worst_stage: int  # pipeline stage (0-based) of the worst rank
    host_bytes: int  # CPU memory per rank for offloaded state (the most of any stage)
    worst_rank: int  # first global rank of the worst stage (pp is the outermost mesh axis)
    peak_phase: str  # planner.memory.phases.PHASES: when the worst rank peaks
    worst_phases: dict[str, Phase]  # the worst stage: phase -> (params, grads, optimizer, activations, comm)
    other_bytes: int  # the fixed overhead, in every phase
    activations: Activations
    published: bool  # megatron / deepspeed: one phase with everything at once
    reserve_bytes: int = 0  # the worst stage's reserved - allocated (planner.memory.reserved), in `other`
    # per distinct stage (id of its shared StageParams): its bytes and reserve; every rank's parameters and
    # in-flight micro-batches. `stages` and `stage_reserve_bytes` are made from them on first access
    _built: dict[int, tuple[StageBytes, int]] = field(default_factory=dict, repr=False)
    _params: tuple[StageParams, ...] = ()
    _in_flight: tuple[float, ...] = ()

    @cached_property
    def stages(self) -> tuple[tuple[StageBytes, StageParams, float], ...]:
        """Every pipeline rank: its bytes, parameters and in-flight micro-batches."""
        return tuple((self._built[id(sp)][0], sp, n) for sp, n in zip(self._params, self._in_flight, strict=True))

    @cached_property
    def stage_reserve_bytes(self) -> tuple[int, ...]:
        """Every rank's reserved - allocated (planner.memory.reserved)."""
        return tuple(self._built[id(sp)][1] for sp in self._params)

    def _breakdown(self, phase: Phase, reserve: int | None = None) -> dict[str, int]:
        reserve = self.reserve_bytes if reserve is None else reserve
        return dict(zip(MEMORY_CATEGORIES, (*phase, self.other_bytes + reserve), strict=True))

    @property
    def allocated_bytes(self) -> int:
        """The worst rank's tensor peak: what torch.cuda.max_memory_allocated would report."""
        return self.peak_bytes - self.other_bytes - self.reserve_bytes

    @property
    def reserved_bytes(self) -> int:
        """The worst rank's caching-allocator peak: what torch.cuda.max_memory_reserved would report."""
        return self.peak_bytes - self.other_bytes

    @cached_property
    def per_stage(self) -> tuple[dict[str, int], ...]:
        """Breakdown (MEMORY_CATEGORIES) of every pipeline stage, each at its own peak phase."""
        phases_of = published_phase if self.published else step_phases
        reserves = self.stage_reserve_bytes or (0,) * len(self.stages)
        return tuple(self._breakdown(peak_phase(phases_of(sb, sp, self.activations, in_flight))[1], reserve)
                     for (sb, sp, in_flight), reserve in zip(self.stages, reserves, strict=True))

    @property
    def breakdown_bytes(self) -> dict[str, int]:
        """The worst rank's breakdown at its peak phase; sums to peak_bytes."""
        return self._breakdown(self.worst_phases[self.peak_phase])

    @cached_property
    def phases(self) -> dict[str, dict[str, int]]:
        """The worst stage's breakdown at every phase of its step."""
        return {name: self._breakdown(p) for name, p in self.worst_phases.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_memory_bytes": self.peak_bytes,
            "allocated_peak_bytes": self.allocated_bytes,
            "reserved_peak_bytes": self.reserved_bytes,
            "memory_breakdown_bytes": self.breakdown_bytes,
            "peak_phase": self.peak_phase,
            "phase_peak_bytes": {name: sum(b.values()) for name, b in self.phases.items()},
            "worst_stage": self.worst_stage,
            "worst_rank": self.worst_rank,
            "host_memory_bytes": self.host_bytes,
            "per_stage_memory_bytes": [dict(s) for s in self.per_stage],
        }


def _activation_comm(model: ModelSpec, training: TrainingSpec, layout: Layout, eng: Engine) -> tuple[int, int]:
    """X: TP/SP, PP, CP and EP buffers of one micro-batch (module docstring table), as (the CP part, the rest).

    The CP part exists only while a block's attention runs; planner.memory.phases
    puts it in the block phases of a phased engine, every other X in every phase.
    """
    d = training.dtype_bytes
    tokens = training.seq_len * layout.micro_batch_size / layout.cp
    act = tokens * model.hidden * d  # one micro-batch's hidden states on this rank
    total, cp_total = 0.0, 0.0
    if layout.tp > 1 and layout.sequence_parallel and not eng.tensor_parallel.saves_gathered_inputs:
        total += 2 * act
    if layout.pp > 1 and not eng.pipeline.stage_outputs:
        total += 2 * act / (layout.tp if layout.sequence_parallel else 1)
    if layout.cp > 1:
        kv_width = model.q_dim if eng.model_code.repeats_kv else model.kv_dim  # repeated to the query heads first
        local_kv = 2 * tokens * kv_width * d / layout.tp
        cp_total = local_kv * layout.cp if eng.context_parallel.gathers_kv else 2 * local_kv
    if layout.ep > 1 and model.moe is not None and not eng.experts.executor_experts:
        total += 2 * model.moe.top_k * act
    return int(cp_total), int(total)


_PER_LAYER: dict[tuple, tuple[ModelSpec, TrainingSpec, Engine, float, float]] = {}


def _layer_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, eng: Engine, fused: bool,
                 autocast: bool) -> tuple[float, float]:
    """(kept per layer, recompute transient) of one micro-batch, cached: a search asks for the same micro-batch,
    tp, cp and recomputation over many data-parallel splits (the key holds what `_layer_bytes_of` reads; the
    model, training and engine by identity, checked on a hit)."""
    chunks = layout.pp * layout.virtual_stages if layout.recompute_layers else 0
    key = (id(model), id(training), id(eng), layout.micro_batch_size, layout.tp, layout.cp, layout.sequence_parallel,
           layout.recompute, layout.recompute_layers, layout.recompute_modules, chunks, fused, autocast)
    hit = _PER_LAYER.get(key)
    if hit is not None and hit[0] is model and hit[1] is training and hit[2] is eng:
        return hit[3], hit[4]
    per_layer, recomputed = _layer_bytes_of(model, training, layout, eng, fused, autocast)
    if len(_PER_LAYER) > 16384:
        _PER_LAYER.clear()
    _PER_LAYER[key] = (model, training, eng, per_layer, recomputed)
    return per_layer, recomputed


def _layer_bytes_of(model: ModelSpec, training: TrainingSpec, layout: Layout, eng: Engine, fused: bool,
                    autocast: bool) -> tuple[float, float]:
    s, b, t, cp = training.seq_len, layout.micro_batch_size, layout.tp, layout.cp
    seq_par, d = layout.sequence_parallel, training.dtype_bytes
    saves_gathered = eng.tensor_parallel.saves_gathered_inputs
    fp8_inputs = training.fp8 and eng.fp8.saves_fp8_inputs
    terms = layer_activation_terms(model, s, b, t, cp, sequence_parallel=seq_par, dtype_bytes=d, fused_attention=fused,
                                   autocast=autocast, sp_saves_gathered=saves_gathered,
                                   fp8_inputs=fp8_inputs, fused_swiglu=eng.model_code.fused_swiglu,
                                   moe_probs_in_experts=eng.experts.probs_in_experts)
    if training.lora:  # frozen linears keep no input for a weight gradient; adapters keep lora_A's output
        terms = lora_activation_terms(model, training, t, s * b / cp, terms)
    op_saved = op_saved_terms(model, s, b, t, cp, dtype_bytes=d, fused_attention=fused) \
        if layout.recompute == "op" else None
    per_layer, recomputed = layer_activation_bytes(terms, layout.recompute, op_saved, selective_modules(layout))
    if layout.recompute == "full" and layout.recompute_layers:  # the chunk's other layers keep everything
        share = recomputed_fraction(layout, model.n_layers)
        per_layer = share * per_layer + (1.0 - share) * sum(terms.values())
    if eng.experts.executor_experts and model.moe is not None and layout.recompute in ("none", "selective"):
        per_layer += _executor_moe_extra(model, s * b / cp, d)
    if eng.context_parallel.saves_gathered and cp > 1 and layout.recompute in ("none", "selective"):
        # executor.parallel.context: attention saves the whole sequence's K/V, gathered from every cp rank and
        # repeated to the query heads (q_dim wide; kv_dim without GQA), beyond the local K/V the terms count
        per_layer += 2 * d * b * s * (model.q_dim - model.kv_dim / cp) / t
    return per_layer, recomputed


def _activations(model: ModelSpec, training: TrainingSpec, layout: Layout, eng: Engine, *,
                 fused: bool) -> Activations:
    """One micro-batch's activation pieces, computed once per estimate and shared by every stage."""
    s, b, t, cp = training.seq_len, layout.micro_batch_size, layout.tp, layout.cp
    seq_par, d = layout.sequence_parallel, training.dtype_bytes
    phased = eng.data_parallel.phased
    autocast = phased and eng.autocast(layout, d, training.lora)
    saves_gathered = eng.tensor_parallel.saves_gathered_inputs
    per_layer, recomputed = _layer_bytes(model, training, layout, eng, fused, autocast)
    # meshplan's executor cuts the rotary tables to the sequence and casts them once per forward
    # (executor.model.Transformer.forward): one s-row copy for all blocks, left out
    vocab_parallel = not model.tie_embeddings or eng.tensor_parallel.splits_tied_vocab
    loss = eng.loss.kind
    saved, logits_saved, logits_transient = output_activation_bytes(
        model, s, b, t, cp, sequence_parallel=seq_par, dtype_bytes=d, autocast=autocast,
        vocab_parallel_loss=vocab_parallel, sp_saves_gathered=saves_gathered,
        dtensor_loss_parallel=loss == "dtensor", fused_loss_parallel_backward=loss == "torch-loss-parallel",
        eager_final_norm=eng.model_code.eager_final_norm)
    logits_grad = logits_saved / FP32_BYTES * d
    if loss == "megatron":  # the saved fp32 softmax becomes the gradient in place (mechanisms.Loss)
        logits_transient = logits_grad
    loss_hole = logits_grad if d < FP32_BYTES and phased else 0.0
    fused_loss = eng.fused_loss(training, layout)
    if fused_loss == "compile":
        # torch.compile'd cross entropy (inductor, replayed on CPU with torch 2.13: 2 B per logit at the
        # backward's start, 4 B at its peak): the D-byte logits saved, the D-byte gradient written by one
        # fused backward kernel, no fp32 tensor and so no hole (under TP the loss stays DTensor's
        # loss_parallel, above: Engine.fused_loss)
        logits_saved = logits_saved / FP32_BYTES * d
        logits_transient, logits_grad, loss_hole = logits_saved, logits_saved, 0.0
    elif fused_loss == "transformer-engine":
        # Transformer Engine's parallel_cross_entropy (cross_entropy.py, triton/cross_entropy.py): the forward
        # stores each logit's gradient over the D-byte logits and saves them; the backward scales them in place
        logits_saved, logits_transient, logits_grad, loss_hole = logits_saved / FP32_BYTES * d, 0.0, 0.0, 0.0
    stage_output = 0.0
    if eng.pipeline.stage_outputs and layout.pp > 1:  # the residual stream: fp32 under autocast
        stage_output = s * b / cp * model.hidden * (FP32_BYTES if autocast else d) / (t if seq_par else 1)
    boundary = None  # zb-v: planner.memory.phases' own rule
    if layout.pp_schedule not in V_SCHEDULES:  # first rank, a middle one, the last rank
        m, v, sched = layout.grad_accum_steps, layout.virtual_stages, layout.pp_schedule
        alive = first_stage_alive(sched, layout.pp, m, v)
        boundary = tuple(boundary_buffers(sched, layout.pp, m, v, first=first, last=last, first_alive=alive)
                         for first, last in ((True, False), (False, False), (False, True)))
    return Activations(per_layer, recomputed, layer_backward_transient(model, s, b, t, cp, d),
                       embedding_dropout_bytes(model, s, b, t, cp, sequence_parallel=seq_par), saved, logits_saved, logits_transient,
                       logits_grad, loss_hole, stage_output,
                       layout.activation_offload_layers * layout.virtual_stages,
                       output_in_flight(layout.pp_schedule, layout.pp), boundary)


def _executor_moe_extra(model: ModelSpec, tokens: float, d: int) -> float:
    """What executor.moe keeps per layer beyond the common MoE terms (planner.memory.activations), averaged
    over the layers: per token the int64 top-k indices, sort order and token map with the fp32 and
    compute-dtype gate weights and their sum (measured with saved-tensor hooks). The experts' compute-dtype
    weights are FSDP2's gathered copies, or autocast's (planner.memory.states: the compute copy)."""
    moe = model.moe
    share = model.n_moe_layers / model.n_layers
    return share * tokens * (moe.top_k * (3 * 8 + FP32_BYTES + d) + FP32_BYTES)


def default_other_bytes(gpu: GPUSpec) -> int:
    """The fixed per-GPU overhead (CUDA context, NCCL, fragmentation) before calibration."""
    return DEFAULT_OTHER_BYTES.get(gpu.kind, DEFAULT_OTHER_BYTES["gpu"])


def estimate_memory(model: ModelSpec, training: TrainingSpec, layout: Layout, gpu: GPUSpec,
                    engine: str | Engine = "meshplan", other_bytes: int | None = None, *,
                    fused_attention: bool | None = None) -> MemoryEstimate:
    """Bytes per rank by category at the peak phase of every pipeline stage; the worst stage is the answer.

    fused_attention: None means the engine's kernel (`planner.engines`), the
    same one the simulator times; False is the papers' eager attention
    (Korthikanti's accounting).
    """
    eng = get_engine(engine)
    fused = eng.fused_attention(training) if fused_attention is None else fused_attention
    other = default_other_bytes(gpu) if other_bytes is None else other_bytes
    acts = _activations(model, training, layout, eng, fused=fused)
    cp_comm, comm = _activation_comm(model, training, layout, eng)
    phased = eng.data_parallel.phased
    build, phases_of = (torch_stage_bytes, step_phases) if phased else (published_stage_bytes, published_phase)
    if phased:
        build = partial(torch_stage_bytes, engine=eng)
    elif eng.fp8_primary_weights(training):  # ZeRO-3 gathers the blocks' 8-bit parameters
        build = partial(published_stage_bytes, block_gather_bytes=fp8_rowwise_bytes(training.precision))
    params = pipeline_params(model, layout, eng)
    in_flight = in_flight_per_rank(layout.pp_schedule, layout.pp, layout.grad_accum_steps, layout.virtual_stages)
    built: dict[int, tuple[StageBytes, int]] = {}  # per stage: bytes, reserved - allocated (planner.memory.reserved)
    worst, worst_peak, worst_name, worst_phases, host_bytes, worst_reserve = -1, -1, "", {}, 0, 0
    for key, rank in busiest_ranks(params, in_flight).items():
        sp = params[rank]
        states = stage_states(model, training, layout, sp, eng, gpu.fp8_any_layout)
        if phased:
            sb = build(model, training, layout, sp, states, comm)._replace(attention_comm=cp_comm)
        else:  # the papers' accounting: every buffer at once
            sb = build(model, training, layout, sp, states, comm + cp_comm)
        offloaded = (sp.layers - on_gpu_layers(sp, acts)) * in_flight[rank] * acts.per_layer
        host_bytes = max(host_bytes, states.host + int(offloaded))
        phases = phases_of(sb, sp, acts, in_flight[rank])
        name, phase = peak_phase(phases)
        reserve = reserve_bytes(sb, sp, acts, phases) if gpu.kind != "cpu" else 0  # no caching allocator
        built[key] = (sb, reserve)
        peak = sum(phase) + reserve
        if peak > worst_peak or (peak == worst_peak and rank < worst):
            worst, worst_peak, worst_name, worst_phases, worst_reserve = rank, peak, name, phases, reserve
    return MemoryEstimate(
        worst_peak + other, worst, host_bytes, worst * (layout.world_size // layout.pp), worst_name, worst_phases,
        other, acts, not phased, worst_reserve, built, params, in_flight)


_BUSIEST: dict[tuple[int, int], tuple[tuple, tuple, dict[int, int]]] = {}


def busiest_ranks(params: tuple[StageParams, ...], in_flight: tuple[float, ...]) -> dict[int, int]:
    """Every phase grows with the in-flight micro-batches: of the ranks holding equal parameters (middle
    stages, one shared StageParams object: planner.memory.params) only the one with the most can be the
    worst. {id of a stage's parameters: that rank}, cached on the two (cached) tuples' identities."""
    key = (id(params), id(in_flight))
    hit = _BUSIEST.get(key)
    if hit is not None and hit[0] is params and hit[1] is in_flight:
        return hit[2]
    busiest: dict[int, int] = {}
    for rank, sp in enumerate(params):
        first = busiest.setdefault(id(sp), rank)
        if in_flight[rank] > in_flight[first]:
            busiest[id(sp)] = rank
    if len(_BUSIEST) > 4096:
        _BUSIEST.clear()
    _BUSIEST[key] = (params, in_flight, busiest)
    return busiest
