"""Engines: everything engine-specific, one object per engine, asked by search, memory and simulation.

An engine is the software that runs the step: meshplan's own executor
(PyTorch FSDP2/DDP/DTensor), Megatron-Core (Megatron-LM, NeMo), torchtitan
(PyTorch FSDP2/HSDP, DTensor TP with loss parallel, per-op SAC, torchao float8)
or DeepSpeed.
What differs between them and changes a prediction lives here and nowhere
else, as torchtitan keeps parallel degrees in one ParallelDims:
- `TimeTraits`: the attention kernel and what overlaps (planner.simulate);
- `MemoryTraits`: how tensors are laid out and kept (planner.memory);
- the precision recipe: bytes per parameter of weights, gradients, optimizer,
  and what 8-bit GEMMs change (`Fp8Recipe`);
- the recompute kinds it implements and whether it compiles blocks;
- for meshplan, the data-parallel path its executor takes (`dp_path`) and the
  layouts it refuses (`executor_refusal`): the executor imports both, so a plan
  for `--engine meshplan` is one `meshplan execute` runs.

Why the executor refuses what it refuses, rule by rule:
- MoE layers stay replicated over tp, so sequence parallel (which would cut
  their output back to sequence shards) is refused with them;
- offload is only FSDP2's CPUOffloadPolicy (optimizer+params under ZeRO-3).
(fp16 on GPUs runs with dynamic loss scaling: executor.components.optim.build_scaler.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import DTYPE_BYTES, TrainingSpec
from topologies.errors import PlanError

FP32_BYTES = DTYPE_BYTES["fp32"]
# torch DDP's bucket_cap_mb default (25 MiB): gradients are reduced bucket by
# bucket, and the last bucket cannot overlap any backward compute.
DDP_BUCKET_BYTES = 25 << 20


PIPE_P2P = ("overlapped", "exchange", "exchange-whole-grads")


@dataclass(frozen=True)
class CommSms:
    """One overlapped TP collective's claim on the GPU's SMs (Transformer Engine userbuffers).

    `sms`: streaming multiprocessors its communication kernel runs on.
    `margin`: the GEMM it overlaps is launched on the other SMs for its whole
    run (TE's set_sm_margin); otherwise the two share the GPU and the GEMM
    loses the SMs only while the communication kernel runs.
    """

    sms: int
    margin: bool

    def __post_init__(self) -> None:
        if not isinstance(self.sms, int) or isinstance(self.sms, bool) or self.sms < 0:
            raise PlanError(f"CommSms.sms must be an integer >= 0, got {self.sms!r}")


@dataclass(frozen=True)
class TpOverlapSms:
    """SMs each overlapped TP collective takes from its GEMM, per TP point (attention, MLP).

    Transformer Engine's userbuffers overlap (Megatron --tp-comm-overlap) runs
    the forward all-gathers and the backward gradient all-gathers as
    ring_exchange over the copy engines (qkv/fc1 fprop, proj/fc2 dgrad: no
    SMs, no margin), and gives SMs to the others: the forward reduce-scatters
    (proj_fprop, fc2_fprop: pipeline or ring_exchange), the backward's bulk
    all-gather of the saved input under the input-gradient GEMM (qkv_dgrad,
    fc1_dgrad) and bulk reduce-scatter of the input gradient under the
    weight-gradient GEMM (qkv_wgrad, fc1_wgrad).
    """

    fprop_rs: tuple[CommSms, CommSms]  # proj_fprop, fc2_fprop
    dgrad_ag: tuple[CommSms, CommSms]  # qkv_dgrad, fc1_dgrad
    wgrad_rs: tuple[CommSms, CommSms]  # qkv_wgrad, fc1_wgrad


# Transformer Engine's initialize_ub defaults (transformer_engine/pytorch/module/base.py,
# get_default_config, TE 2.x): ring_exchange num_sm 1 without margin, pipeline and bulk num_sm 16
# with set_sm_margin; what a recipe without its own userbuffers config runs.
_TE16 = CommSms(16, True)
TE_UB_DEFAULT = TpOverlapSms((_TE16, _TE16), (_TE16, _TE16), (_TE16, _TE16))
# torchtitan's async TP (symmetric-memory micro-pipelining) moves chunks with copy-engine p2p copies
NO_SMS = TpOverlapSms((CommSms(0, False),) * 2, (CommSms(0, False),) * 2, (CommSms(0, False),) * 2)


@dataclass(frozen=True)
class TimeTraits:
    """How an engine runs a step, where that changes the time."""

    fused_attention: bool  # FlashAttention-style kernel; else softmax over materialized scores
    overlap_dp: bool  # gradient reduction overlapped with the last micro-batch's backward
    overlap_tp_backward: bool = False  # backward TP all-reduces overlap the weight-gradient GEMMs
    # How activations and their gradients cross a pipeline boundary (PIPE_P2P):
    # "overlapped": one transfer per direction that only delays its consumer (Megatron's batched
    #   isend/irecv, torch.distributed.pipelining);
    # "exchange": DeepSpeed's PipelineEngine. Every step of its TrainSchedule opens with a blocking
    #   exchange with one neighbour (send the activation then receive the gradient, or the
    #   reverse), which holds both stages; with tp > 1 each tensor crosses split over the tp ranks
    #   (PartitionedTensor, 1/t per rank) and is all-gathered over tp where it is used;
    # "exchange-whole-grads": the same before DeepSpeed 0.5.4 (2021-09-29): gradients cross whole
    #   (t times the bytes of a split one) and the sender all-gathers its split output back for the backward.
    pipe_p2p: str = "overlapped"
    # full recomputation also recomputes the model's ends (embedding, tied output layer): DeepSpeed's
    # PipelineModule checkpoints every module that has parameters (activation_checkpoint_interval)
    recompute_pipe_ends: bool = False
    # HBM bytes per local parameter per micro-batch that fold a bf16 micro-batch's gradients into
    # fp32 accumulators outside the GEMMs (0: the fold runs inside the weight-gradient GEMM, or
    # autograd hands over the first gradient). DeepSpeed's BF16_Optimizer (its bf16 path under
    # ZeRO 0/1, deepspeed/runtime/bf16_optimizer.py; the pipeline engine calls update_hp_grads
    # after every backward, clearing the bf16 gradients before the next) adds a materialized
    # fp32 cast of each bf16 gradient: cast 2 + 4, add 4 + 4 + 4 = 18 B.
    bf16_grad_fold_bytes: float = 0.0
    # under async TP (TrainingSpec.async_tp), the SMs each overlapped collective takes from its GEMM
    tp_overlap_sms: TpOverlapSms = NO_SMS

    def __post_init__(self) -> None:
        if self.pipe_p2p not in PIPE_P2P:
            raise PlanError(f"pipe_p2p must be one of {PIPE_P2P}, got {self.pipe_p2p!r}")


@dataclass(frozen=True)
class MemoryTraits:
    """How an engine lays tensors out, where that changes memory (not time: see TimeTraits)."""

    vocab_parallel_loss: bool  # logits stay split by t into the loss; else gathered to V per rank
    tied_vocab_parallel: bool  # a tied embedding/output matrix is split by t like an untied one
    ddp_bucket_copy: bool  # DDP buckets duplicate the gradients (gradient_as_bucket_view=False)
    fsdp_root_unit: bool  # embedding, final norm and output form one FSDP unit with the stage root
    step_phases: bool  # gradients freed between steps: the peak is the largest phase of a step
    rope_buffers: bool  # fp32 RoPE tables of the full context as buffers; blocks keep compute-dtype copies
    zero1_whole_tensors: bool  # ZeRO-1 hands whole tensors, largest first, to the least-loaded rank
    sp_saves_gathered: bool  # sequence parallel saves the all-gathered projection inputs (PyTorch DTensor)
    fp32_params: bool  # parameters stored in fp32 and cast for compute (autocast / FSDP2 mixed precision)
    fp32_grads: bool  # gradients kept in fp32 whatever the compute dtype
    zero2_shards_params: bool  # ZeRO-2 already keeps parameters sharded between steps (FSDP2)
    fused_swiglu: bool = False  # one fused SwiGLU kernel saves its 2f-wide input only (Megatron): 3f kept, not 4f
    # the router's probabilities weigh the experts' activation (Megatron-Core >= 0.13 TEGroupedMLP, permuted_probs),
    # so the combine only unpermutes and no expert output is kept for it (planner.memory.activations)
    moe_probs_in_experts: bool = False
    shard_over_cp: bool = False  # ZeRO/FSDP shards over dp_shard * cp (Megatron's dp-cp group, torchtitan's dp_shard_cp)
    # vocabulary-parallel loss by DTensor's loss_parallel: compute-dtype logits, their fp32 copy and the
    # log-probabilities saved per local logit, 12 B more in the loss backward (validate-memory, TP x FSDP)
    dtensor_loss_parallel: bool = False
    # meshplan's MoE executor (executor.moe, executor.parallel.expert): routed experts outside FSDP2's units,
    # their fp32 weights cast per call and saved for the backward (E x 2-3 h x f_e x D per MoE layer, whatever
    # ep), int64 routing indices kept, and the all-to-all outputs are the saved expert inputs/outputs (no
    # separate dispatch buffers). Measured with PyTorch's tracker (validate-memory, debug-moe ep 2)
    executor_experts: bool = False
    # torch.distributed.pipelining (meshplan's executor) keeps each in-flight micro-batch's stage output for
    # its backward, and a non-last stage receives one output gradient; the boundary tensor is the residual
    # stream, fp32 under autocast (planner.memory.estimate; validate-memory, pp 2 1F1B)
    pp_stage_outputs: bool = False
    # context parallel all-gathers the K/V of the whole sequence before attention (torch's
    # context_parallel with its default rotate method "allgather", meshplan's executor) instead of
    # passing chunks around a ring (Transformer Engine's default p2p): the gathered K/V is the buffer
    cp_all_gather: bool = False
    # autograd saves the all-gathered K/V for the attention's backward (meshplan's executor:
    # executor.parallel.context gathers outside the kernel); torch's context_parallel saves the
    # local shards and gathers again in the backward
    cp_saves_gathered: bool = False
    activation_offload: bool = False  # N layers' activations to the host (Megatron-Core cpu_offloading, TE)
    # per-op SAC saves float8 GEMM outputs: meshplan's executor lists aten._scaled_mm with aten.mm; torchtitan's
    # _op_sac_save_list names aten.mm only, so its float8 projections (aten._scaled_mm) are all recomputed
    op_sac_saves_fp8_mm: bool = True
    # Megatron-Core's vocab-parallel cross entropy casts the logits to fp32 once and its backward turns that
    # saved buffer into the gradient in place: only the compute-dtype logits gradient is new
    inplace_loss_backward: bool = False
    # DeepSpeed's BF16_Optimizer (bf16_optimizer_runs) keeps full-size fp32 gradient accumulators beside
    # the bf16 gradients, unsharded under ZeRO-1 (all-reduced whole, each rank steps its partition)
    bf16_fp32_grads: bool = False


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of one engine's precision recipe, before sharding."""

    param: int  # stored parameters (the master weights when fp32_params)
    grad: int
    optimizer: int  # master copy (when separate) + moments
    shard_params: bool  # parameter storage sharded over dp_shard
    shard_grads: bool
    shard_optimizer: bool


@dataclass(frozen=True)
class Fp8Recipe:
    """What an engine changes when its block GEMMs run in fp8/mxfp8 (TrainingSpec.precision).

    Every engine keeps the attention core, norms, embedding, output layer,
    gradients' reduction and the optimizer in the 16/32-bit recipe; only the
    linear layers of the transformer blocks cast their operands to 8 bits.
    """

    weight_copy_bytes: float  # persistent 8-bit copies per block-linear parameter (beyond the 16/32-bit weights)
    saves_fp8_inputs: bool  # linear layers save their 8-bit cast input for the backward (else the 16-bit one)
    fp8_all_gather: bool  # FSDP all-gathers block-linear weights in 8 bits (1 byte, not the dtype's)


@dataclass(frozen=True)
class Engine:
    """One engine's traits, precision recipe and (for meshplan) executor rules."""

    name: str
    time: TimeTraits
    memory: MemoryTraits
    executes: bool  # `meshplan execute` runs its plans; others are exported
    fp8: Fp8Recipe = Fp8Recipe(0.0, False, False)
    recompute_kinds: tuple[str, ...] = ("none", "selective", "full")  # lightest first
    compiles: bool = False  # --compile (torch.compile per block) means something for this engine
    partial_recompute: bool = False  # full recomputation of N layers per chunk (Layout.recompute_layers)
    # selective recomputation of named modules (Layout.recompute_modules: Megatron-Core's --recompute-modules)
    recompute_modules: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # data-parallel sharding the engine implements
    # what a step with eager attention runs on, where that is an older release of the engine
    # whose overlap differs too (megatron: the 2021-22 Megatron-LM); None: `time` with eager attention
    eager_time: TimeTraits | None = None
    # context parallelism runs only inside a fused attention kernel (Transformer Engine's
    # AttnFuncWithCP*, torch's ring attention over the SDPA flash/efficient/cuDNN ops; Megatron's
    # own DotProductAttention asserts cp == 1): eager attention with cp > 1 is refused
    cp_needs_fused: bool = False
    # the engine's option that pipelines SP's all-gathers / reduce-scatters with their GEMMs
    # (TrainingSpec.async_tp; planner.simulate.tp_overlap); "" where it has none
    async_tp_option: str = ""
    async_tp_needs_compile: bool = False  # torchtitan applies it as an Inductor pass: torch.compile required

    def recipe(self, dtype_bytes: int, optimizer: str, zero_stage: int, grad_bytes: int = FP32_BYTES,
               dtype: str = "") -> Recipe:
        """grad_bytes: the training's grad_dtype, which sets the gradient buffers of engines that keep
        16-bit parameters with separate main gradients (Megatron's grad_reduce_in_fp32 off: 2 bytes);
        dtype: the compute dtype's name (bf16 turns on DeepSpeed's BF16_Optimizer)."""
        fp32_copy = self.memory.bf16_fp32_grads and bf16_optimizer_runs(dtype, zero_stage)
        return _recipe(self.memory, dtype_bytes, optimizer, zero_stage, grad_bytes, fp32_copy)

    def refusal(self, model: ModelSpec, layout: Layout, dtype: str, on_gpu: bool,
                training: TrainingSpec | None = None) -> str | None:
        """Why this engine's plans cannot hold `layout` (unsupported recompute kinds, meshplan's executor)."""
        if layout.recompute not in self.recompute_kinds:
            return (f"engine {self.name} does not implement recompute {layout.recompute!r}; it has "
                    f"{', '.join(self.recompute_kinds)}")
        modules = _recompute_modules_refusal(self, model, layout, training)
        if modules:
            return modules
        if layout.cp > 1 and self.cp_needs_fused and training is not None and not self.fused_attention(training):
            return (f"engine {self.name} runs context parallelism (cp {layout.cp}) only inside a fused attention "
                    "kernel; use --attention fused or --cp 1")
        if training is not None and training.async_tp and (layout.tp == 1 or not layout.sequence_parallel):
            return (f"async TP pipelines the all-gathers and reduce-scatters of sequence parallelism: it needs "
                    f"tp > 1 with sequence parallel, got tp {layout.tp}"
                    f"{'' if layout.sequence_parallel else ' without sequence parallel'}; "
                    "allow --tp > 1 and --sequence-parallel, or drop --async-tp")
        if layout.activation_offload_layers and not self.memory.activation_offload:
            return (f"engine {self.name} does not offload activations to the host (activation_offload_layers "
                    f"{layout.activation_offload_layers}); plan with 0, or with --engine megatron")
        if layout.zero_stage not in self.zero_stages:
            return (f"engine {self.name} does not implement ZeRO-{layout.zero_stage}; it has ZeRO "
                    f"{', '.join(map(str, self.zero_stages))}")
        if not self.executes:
            return None
        return executor_refusal(model, layout, dtype, on_gpu, training)

    def fused_attention(self, training: TrainingSpec) -> bool:
        """The attention kernel a step runs: the training's `attention`, else this engine's default."""
        return training.fused_attention(self.time.fused_attention)

    def time_for(self, attention: str) -> TimeTraits:
        """The time traits of a step whose training asks for `attention` ("" = this engine's kernel)."""
        if attention == "eager" and self.eager_time is not None:
            return self.eager_time
        return self.time

    def op_sac_saves_mm(self, training: TrainingSpec) -> bool:
        """Whether per-op SAC saves the block GEMMs this training runs (memory keeps them, time skips them)."""
        return self.memory.op_sac_saves_fp8_mm or not training.fp8

    def fp8_weight_bytes(self, training: TrainingSpec) -> float:
        """Persistent 8-bit weight-copy bytes per block-linear parameter under this training's precision."""
        return self.fp8.weight_copy_bytes if training.fp8 else 0.0


def bf16_optimizer_runs(dtype: str, zero_stage: int) -> bool:
    """Whether DeepSpeed trains through its BF16_Optimizer: bf16 with fp32 gradient accumulation
    (its default) under ZeRO 0 or 1 (DeepSpeedEngine's optimizer choice; ZeRO 2/3 use their own)."""
    return dtype == "bf16" and zero_stage <= 1


@lru_cache(maxsize=256)
def _recipe(traits: MemoryTraits, dtype_bytes: int, optimizer: str, zero_stage: int,
            grad_bytes: int = FP32_BYTES, fp32_grad_copy: bool = False) -> Recipe:
    moments = 8 if optimizer == "adamw" else 4  # AdamW: two fp32 moments; SGD: one momentum
    shards = dict(shard_grads=zero_stage >= 2, shard_optimizer=zero_stage >= 1,
                  shard_params=zero_stage >= (2 if traits.zero2_shards_params else 3))
    grad = (grad_bytes if not traits.fp32_params else FP32_BYTES) if traits.fp32_grads else dtype_bytes
    grad += FP32_BYTES if fp32_grad_copy else 0
    if traits.fp32_params:  # the fp32 parameters are the master weights
        return Recipe(FP32_BYTES, grad, moments, **shards)
    master = FP32_BYTES if dtype_bytes < FP32_BYTES else 0
    return Recipe(dtype_bytes, grad, master + moments, **shards)


# meshplan: what executor/parallel/parallelize.py, executor/model.py and
# executor/components/optim.py do: SDPA (fused) attention; DDP/FSDP2 overlap the
# gradient reduction with the backward; DTensor TP runs its collectives in line.
# The output layer is ColwiseParallel(output_layouts=Replicate()) (logits
# gathered), a tied embedding is not TP-sharded, DDP keeps its default
# gradient_as_bucket_view=False, fully_shard(part) makes the embedding, final
# norm and output one root unit, gradients are set to None after every step
# (phases measured with PyTorch's tracker: validate-memory), the model keeps
# rope_cos/rope_sin buffers of max_seq_len rows, ZeRO-1 is torch's
# ZeroRedundancyOptimizer, sequence parallel is DTensor's PrepareModuleInput
# (saves the gathered inputs), and parameters are fp32 under autocast or FSDP2
# MixedPrecisionPolicy.
#
# megatron: Megatron-Core as people run it today (Megatron-LM, NeMo): Transformer
# Engine's fused attention, the distributed optimizer's gradient reduction
# overlapped with the backward, the TP all-reduce of the input gradient under the
# weight-gradient GEMM; vocabulary-parallel embedding, output and cross-entropy;
# gradients accumulate in a persistent fp32 contiguous buffer, so every state and
# buffer is counted at once (the papers' accounting); flat, evenly sharded
# optimizer; sequence parallel saves shards and gathers again in the backward.
# It reproduces published NeMo H100 runs within 1-4% MAPE
# (bench/accuracy_published.py).
#
# deepspeed: Megatron-DeepSpeed on DeepSpeed's PipelineEngine (DEEPSPEED_PIPE_2022:
# eager attention, gradients reduced after the backward, blocking pipeline
# exchanges), otherwise Megatron's layout with gradients in the compute dtype (under bf16 and
# ZeRO 0/1 also in fp32: BF16_Optimizer, bf16_optimizer_runs).
_PUBLISHED_MEMORY = dict(vocab_parallel_loss=True, tied_vocab_parallel=True, ddp_bucket_copy=False,
                         fsdp_root_unit=False, step_phases=False, rope_buffers=False, zero1_whole_tensors=False,
                         sp_saves_gathered=False, fp32_params=False, zero2_shards_params=False)
# The 2021-22 Megatron-LM (the Narayanan 2021 and Korthikanti 2022 papers, and
# the Megatron-DeepSpeed behind MT-NLG and vTrain's A100 measurements): eager
# softmax attention with dropout; the data-parallel all-reduce runs after the
# whole forward-backward (Megatron-LM's default --DDP-impl local calls
# allreduce_gradients() after forward_backward_func, releases of May 2021 and
# May 2022 alike; DeepSpeed's pipeline engine reduces after its last backward),
# and the backward TP all-reduce runs under the weight-gradient GEMM
# (--async-tensor-model-parallel-allreduce, on by default in 2022; the 2021
# release ran it in line). The A100 profile is fitted with these traits
# (bench/accuracy_vtrain.py: 7.6% vs 7.7% multi-node MAPE without the async
# all-reduce), and `--engine megatron --attention eager` runs on them.
# DeepSpeed's bf16 gradient fold (TimeTraits.bf16_grad_fold_bytes): MT-NLG trained in bf16 on a
# DeepSpeed of 2021 with no public bf16 pipeline path; the first one DeepSpeed published
# (BF16_Optimizer, "bf16+pipeline parallelism", PR 1801, 2022) is priced for that stack too.
DEEPSPEED_BF16_FOLD_BYTES = 2.0 + 4.0 + 3 * 4.0
MEGATRON_DEEPSPEED_2022 = TimeTraits(fused_attention=False, overlap_dp=False, overlap_tp_backward=True)
# Megatron-DeepSpeed on DeepSpeed's PipelineEngine (deepspeed/runtime/pipe), the
# 2022 release: the same overlap, but the pipeline boundaries are DeepSpeed's
# blocking exchanges of tp-split tensors (TimeTraits.pipe_p2p "exchange";
# DeepSpeed >= 0.5.4 splits activations and gradients, PartitionedTensor). The
# `deepspeed` engine runs on it.
DEEPSPEED_PIPE_2022 = TimeTraits(fused_attention=False, overlap_dp=False, overlap_tp_backward=True,
                                 pipe_p2p="exchange", bf16_grad_fold_bytes=DEEPSPEED_BF16_FOLD_BYTES)
# The same stack as MT-NLG 530B ran it in 2021 (Smith et al. 2022): DeepSpeed
# before 0.5.4 sent gradients whole over 2-rank broadcast groups (the
# activations already split), and its PipelineModule checkpointed every module
# with parameters, so full recomputation also re-ran the embedding and the tied
# output layer (from 0.5.4 only ParallelTransformerLayerPipe for GPTModelPipe);
# the Megatron-DeepSpeed fork ran the backward TP all-reduce in line (Megatron-LM's
# async all-reduce reached it in its 2021-12-10 sync).
DEEPSPEED_PIPE_2021 = TimeTraits(fused_attention=False, overlap_dp=False, overlap_tp_backward=False,
                                 pipe_p2p="exchange-whole-grads", recompute_pipe_ends=True,
                                 bf16_grad_fold_bytes=DEEPSPEED_BF16_FOLD_BYTES)
# Transformer Engine (megatron): the fp8 weight workspace persists between
# micro-batches and steps (Megatron-Core marks the first micro-batch so the
# cast is cached), one byte per weight plus a 1-byte scale per 32 elements
# for MXFP8; the transposed copy the backward needs is counted as transient.
# Two persistent copies would put NVIDIA's Nemotron-4 15B FP8 run (tp 2, DGX
# Cloud v25.04) at 82.6 GiB, above the 80 GB it ran on; one gives 76.6 GiB.
# te.Linear saves its fp8-cast input for the backward. Without
# --fp8-param-gather (off by default) the distributed optimizer gathers bf16.
# torchao float8 (torchtitan): Float8Linear casts in the forward and saves the
# high-precision input and weight, recasting in the backward (no persistent
# copy); with FSDP2 torchtitan gathers the weights in float8
# (enable_fsdp_float8_all_gather, which its float8 recipes turn on).
TE_FP8 = Fp8Recipe(weight_copy_bytes=1.0 + 1.0 / 32, saves_fp8_inputs=True, fp8_all_gather=False)
TORCHAO_FP8 = Fp8Recipe(weight_copy_bytes=0.0, saves_fp8_inputs=False, fp8_all_gather=True)
ENGINES: dict[str, Engine] = {
    "meshplan": Engine(
        "meshplan", TimeTraits(fused_attention=True, overlap_dp=True),
        MemoryTraits(vocab_parallel_loss=True, tied_vocab_parallel=False, ddp_bucket_copy=True, fsdp_root_unit=False,
                     step_phases=True, rope_buffers=True, zero1_whole_tensors=True, sp_saves_gathered=True,
                     fp32_params=True, fp32_grads=True, zero2_shards_params=True, dtensor_loss_parallel=True,
                     shard_over_cp=True, executor_experts=True, cp_all_gather=True, cp_saves_gathered=True,
                     pp_stage_outputs=True),
        executes=True, fp8=TORCHAO_FP8, recompute_kinds=("none", "selective", "op", "full"), compiles=True),
    "megatron": Engine("megatron", TimeTraits(fused_attention=True, overlap_dp=True, overlap_tp_backward=True,
                                              tp_overlap_sms=TE_UB_DEFAULT),
                       MemoryTraits(fp32_grads=True, fused_swiglu=True, moe_probs_in_experts=True, shard_over_cp=True,
                                    activation_offload=True,
                                    inplace_loss_backward=True, **_PUBLISHED_MEMORY),
                       executes=False, fp8=TE_FP8, partial_recompute=True, recompute_modules=True,
                       eager_time=MEGATRON_DEEPSPEED_2022,
                       cp_needs_fused=True, async_tp_option="--tp-comm-overlap"),
    # torchtitan (PyTorch-native): FSDP2 fully_shard per block with bf16 params/fp32 reduce,
    # DTensor TP with loss parallel (logits stay split into the loss), PrepareModuleInput sequence
    # parallel (saves gathered inputs), SDPA (fused) attention, per-op SAC ("op") or whole-block
    # ("full") checkpointing, torch.compile per block, torchao float8. Its rotary table is a
    # complex buffer that FSDP2 does not cast, so no per-block copies.
    "torchtitan": Engine(
        "torchtitan", TimeTraits(fused_attention=True, overlap_dp=True),
        MemoryTraits(vocab_parallel_loss=True, tied_vocab_parallel=False, ddp_bucket_copy=False, fsdp_root_unit=True,
                     step_phases=True, rope_buffers=False, zero1_whole_tensors=False, sp_saves_gathered=True,
                     fp32_params=True, fp32_grads=True, zero2_shards_params=True, shard_over_cp=True,
                     cp_all_gather=True, op_sac_saves_fp8_mm=False),
        executes=False, fp8=TORCHAO_FP8, recompute_kinds=("none", "op", "full"), compiles=True, cp_needs_fused=True,
        zero_stages=(0, 2, 3),  # DDP / replicate, FSDP2 without or with resharding after forward
        async_tp_option="enable_async_tensor_parallel", async_tp_needs_compile=True),
    "deepspeed": Engine("deepspeed", DEEPSPEED_PIPE_2022,
                        MemoryTraits(fp32_grads=False, bf16_fp32_grads=True, **_PUBLISHED_MEMORY), executes=False),
}
ENGINE_NAMES = tuple(ENGINES)


def _recompute_modules_refusal(engine: Engine, model: ModelSpec, layout: Layout,
                               training: TrainingSpec | None) -> str | None:
    """Why `layout.recompute_modules` cannot run: an engine without Megatron-Core's module list, or a module
    Megatron-Core's TransformerConfig refuses for this model (mla_up_proj without MLA, moe_act without the
    grouped-GEMM experts it is written for)."""
    modules = layout.recompute_modules
    if not modules:
        return None
    named = f"recompute_modules {','.join(modules)}"
    if not engine.recompute_modules:
        return (f"engine {engine.name} has no per-module selective recomputation ({named}); it is Megatron-Core's "
                "--recompute-modules: plan with --engine megatron, or drop --recompute-modules")
    if "mla_up_proj" in modules and model.mla is None:
        return f"{named}: mla_up_proj recomputes MLA's up-projections, and {model.name} has no MLA attention"
    if "moe_act" in modules and (model.moe is None or (training is not None and not training.moe_grouped_gemm)):
        why = f"{model.name} has no MoE layers" if model.moe is None else "the experts run without grouped GEMM"
        return f"{named}: Megatron-Core recomputes moe_act only in grouped-GEMM experts, and {why}"
    return None



def get_engine(name: str) -> Engine:
    """The engine called `name`; a PlanError naming the choices otherwise."""
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise PlanError(f"engine must be one of {ENGINE_NAMES}, got {name!r}") from None


def dp_path(layout: Layout) -> str:
    """How meshplan's executor syncs gradients: none, ddp, replicate (DTensor params, FSDP2 replicate) or fsdp.

    executor.parallel.parallelize applies exactly this path; planner.memory
    prices its buffers.
    """
    if layout.dp * layout.cp == 1:  # cp ranks see other tokens of the same sequences: their gradients sync too
        return "none"
    if layout.zero_stage >= 2:
        return "fsdp"
    return "replicate" if layout.tp > 1 or layout.pp > 1 else "ddp"


# Model features executor/model.py and executor/moe.py build: anything else is refused by name.
_MODEL_DEFAULTS = dict(mla=None, qkv_bias=False, attention_bias=False, attention_sinks=False, qk_norm=False,
                       norms_per_layer=2, sliding_window=0, sliding_layers=0, mtp_layers=0)
_MOE_DEFAULTS = dict(first_dense_layers=0, layer_step=1, layer_phase=0, dense_layers=(), router_bias=False,
                     expert_bias=False, shared_expert_gate=False, capacity_factor=0.0)


def _unbuilt_features(model: ModelSpec) -> list[str]:
    """Names of the model's non-default fields the executor has no module for."""
    out = [k for k, v in _MODEL_DEFAULTS.items() if getattr(model, k, v) != v]
    if model.moe is not None:
        out += [f"moe.{k}" for k, v in _MOE_DEFAULTS.items() if getattr(model.moe, k, v) != v]
    return out


def _fp8_refusal(model: ModelSpec, layout: Layout, training: TrainingSpec, on_gpu: bool) -> str | None:
    """What the executor's torchao float8 path (executor.components.float8) does not run."""
    if training.precision != "fp8":
        return (f"precision {training.precision}: the executor's 8-bit path is torchao's float8 (tensorwise "
                "scaling); plan with --precision fp8 or bf16, or --engine megatron for mxfp8")
    if not on_gpu:
        return ("precision fp8 on CPU ranks: float8 GEMMs (torch._scaled_mm) need a GPU of compute capability "
                "8.9 or newer (H100, L4, B200...); plan CPU ranks with --precision bf16")
    if layout.tp > 1:
        return (f"precision fp8 with tp ({layout.tp}) > 1: the executor does not apply torchao's float8 "
                "tensor-parallel styles; plan with --tp 1 or --precision bf16")
    if training.dtype != "bf16":
        return f"precision fp8 runs on bf16 compute (torchtitan's recipe), not {training.dtype}; plan with --dtype bf16"
    return None


def executor_refusal(model: ModelSpec, layout: Layout, dtype: str = "bf16", on_gpu: bool = True,
                     training: TrainingSpec | None = None) -> str | None:
    """Why meshplan's executor cannot run this layout (one sentence with the values), or None."""
    if training is not None and training.fp8:
        reason = _fp8_refusal(model, layout, training, on_gpu)
        if reason:
            return reason
    unbuilt = _unbuilt_features(model)
    if unbuilt:
        can = ", ".join(name for name, eng in ENGINES.items() if not eng.executes)
        return (f"model {model.name!r} uses {', '.join(unbuilt)}, which meshplan's executor does not build; plan "
                f"it with --engine {can.replace(', ', ' or --engine ')} and export the layout to that stack")
    if layout.etp > 1:
        return f"etp ({layout.etp}) > 1: the executor does not split experts by tensor parallelism; plan with --etp 1"
    if model.moe is not None and (model.moe.n_experts % layout.ep or (layout.dp_shard * layout.cp) % layout.ep):
        return (f"ep ({layout.ep}) must divide the {model.moe.n_experts} experts of model {model.name!r} and "
                f"dp_shard x cp ({layout.dp_shard * layout.cp}): the executor carves ep from the data-parallel "
                "ranks; plan with another --ep")
    if model.moe is not None and layout.zero_stage == 1 and layout.dp > 1:
        return (f"model {model.name!r} with ZeRO-1: the executor's ZeRO-1 broadcasts each parameter from its "
                "owner over dp, which would overwrite the other ep ranks' experts; plan with --zero 0, 2 or 3")
    if model.moe is not None and layout.tp > 1 and layout.sequence_parallel:
        return (f"model {model.name!r} with tp ({layout.tp}) and sequence parallel: the executor keeps MoE "
                "layers replicated over tp and does not cut their output back to sequence shards; plan "
                "without --sequence-parallel")
    if layout.offload != "none" and not (layout.offload == "optimizer+params" and layout.zero_stage == 3):
        return (f"offload {layout.offload!r} with zero_stage {layout.zero_stage}: the executor offloads only "
                "'optimizer+params' under ZeRO-3 (FSDP2 CPUOffloadPolicy); plan with offload none")
    return None
