"""What an engine does, as data: the traits that time and memory read, and its precision recipe.

planner.engines.registry builds one Engine per stack from these; planner.simulate
reads TimeTraits, planner.memory reads MemoryTraits and the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.training import DTYPE_BYTES
from topologies.errors import PlanError

FP32_BYTES = DTYPE_BYTES["fp32"]
# torch DDP's bucket_cap_mb default (25 MiB): gradients are reduced bucket by
# bucket, and the last bucket cannot overlap any backward compute.
DDP_BUCKET_BYTES = 25 << 20


PIPE_P2P = ("overlapped", "exchange", "exchange-whole-grads")
CP_ROTATE = ("ring", "allgather")


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
    # How context parallelism moves K/V (CP_ROTATE), planner.simulate:
    # "ring": cp - 1 point-to-point steps, each hidden under the whole attention core (Transformer Engine's
    #   p2p ring, Megatron's default cp_comm_type);
    # "allgather": PyTorch's context_parallel with its default rotate method: one K/V all-gather hidden only
    #   under the first of cp SDPA calls, fp32 output merges, a re-gather and fp32 dK/dV sends in the
    #   backward (planner.simulate.context)
    cp_rotate: str = "ring"
    # the model repeats GQA's K/V heads to the query heads before SDPA (torchtitan's Llama repeat_kv, through
    # torchtitan ff0829c10 of 2026-01-27), so context parallelism moves query-wide K/V: its time here and its
    # exchange buffer in planner.memory.estimate read this one flag
    sdpa_repeats_kv: bool = False

    def __post_init__(self) -> None:
        if self.pipe_p2p not in PIPE_P2P:
            raise PlanError(f"pipe_p2p must be one of {PIPE_P2P}, got {self.pipe_p2p!r}")
        if self.cp_rotate not in CP_ROTATE:
            raise PlanError(f"cp_rotate must be one of {CP_ROTATE}, got {self.cp_rotate!r}")


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
    # vocabulary-parallel loss by DTensor's loss_parallel as meshplan's executor runs it: the same bytes as
    # fused_loss_parallel_backward (validate-memory, Llama 3 8B at TP 4 x FSDP 16)
    dtensor_loss_parallel: bool = False
    # vocabulary-parallel loss by DTensor's loss_parallel as torch runs it alone: the fp32 log-probabilities
    # saved (4 B per local logit) and its fused nll_loss + log_softmax backward's three fp32 tensors beside
    # them (12 B; planner.memory.activations.LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES)
    fused_loss_parallel_backward: bool = False
    # the final RMSNorm runs eagerly (torchtitan compiles each block, not the model's ends; its RMSNorm module
    # normalizes an fp32 copy of the input): the copy and the normalized output are saved, 4 + D bytes per
    # element instead of a fused kernel's input (planner.memory.activations.output_activation_bytes)
    eager_final_norm: bool = False
    # meshplan's MoE executor (executor.moe, executor.parallel.expert): routed experts as FSDP2 units of
    # their own sharded over dp_shard x cp / ep (whole over tp, whose ranks all run them), int64 routing
    # indices kept, and the all-to-all outputs are the saved expert inputs/outputs (no separate dispatch
    # buffers). Measured with PyTorch's tracker (validate-memory, debug-moe ep 2)
    executor_experts: bool = False
    # torch.distributed.pipelining (meshplan's executor; torchtitan, whose late-2024 torch did the same) keeps each in-flight micro-batch's stage output for
    # its backward and one receive buffer per micro-batch for a non-first stage's input and a non-last
    # stage's output gradient (planner.memory.boundary.boundary_buffers); the boundary tensor is the
    # residual stream, fp32 under autocast (validate-memory: pp 2 1F1B and interleaved 1F1B)
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
    # Megatron-Core's vocab-parallel cross entropy casts the logits to fp32 once and its backward turns that
    # saved buffer into the gradient in place: only the compute-dtype logits gradient is new
    inplace_loss_backward: bool = False
    # the engine can run the loss as Transformer Engine's parallel_cross_entropy (TrainingSpec.fused_cross_entropy),
    # whose forward writes the gradient into the compute-dtype logits it saves: D bytes per local logit, no fp32
    fused_cross_entropy: bool = False
    # ... and that loss is the plain cross entropy under torch.compile (torchtitan's build_cross_entropy_loss
    # compiles it with --training.compile from its commit bbb1b616e, 2025-04; not at 9dec370): inductor saves
    # the compute-dtype logits and writes a compute-dtype gradient, D + D bytes per logit
    compiled_cross_entropy: bool = False
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

    weight_copy: bool  # keeps 8-bit copies of the block-linear weights between micro-batches and steps
    saves_fp8_inputs: bool  # linear layers save their 8-bit cast input for the backward (else the 16-bit one)
    fp8_all_gather: bool  # FSDP all-gathers block-linear weights in 8 bits (1 byte, not the dtype's)
    # the 8-bit copies can be the parameters themselves (TrainingSpec.fp8_params: Transformer Engine's
    # quantized_model_init under Megatron-Core's --fp8-param-gather), with no 16-bit weights beside them
    primary_weights: bool = False

    def weight_bytes(self, precision: str, any_layout: bool) -> float:
        """Bytes of 8-bit weight data per block-linear parameter (0 without copies).

        A row-wise copy for the forward GEMM (1 B; MXFP8 adds an E8M0 scale per
        32 elements) and, where the backward's GEMMs need the other layout, a
        column-wise one: always under MXFP8 (its scales run along the other
        axis), and for per-tensor fp8 on GPUs whose FP8 GEMMs take only the TN
        layout (Hopper: Transformer Engine's Float8Tensor keeps a transpose
        beside its data; quantizer.cpp makes none where
        nvte_is_non_tn_fp8_gemm_supported, sm_100 on).
        """
        if not self.weight_copy:
            return 0.0
        rowwise = fp8_rowwise_bytes(precision)
        return rowwise + (rowwise if precision == "mxfp8" or not any_layout else 0.0)


def fp8_rowwise_bytes(precision: str) -> float:
    """Bytes per element of one 8-bit copy: 1, plus MXFP8's E8M0 scale per 32-element block."""
    return 1.0 + (1.0 / 32 if precision == "mxfp8" else 0.0)


def bf16_optimizer_runs(dtype: str, zero_stage: int) -> bool:
    """Whether DeepSpeed trains through its BF16_Optimizer: bf16 with fp32 gradient accumulation
    (its default) under ZeRO 0 or 1 (DeepSpeedEngine's optimizer choice; ZeRO 2/3 use their own)."""
    return dtype == "bf16" and zero_stage <= 1


@lru_cache(maxsize=256)
def precision_recipe(traits: MemoryTraits, dtype_bytes: int, optimizer: str, zero_stage: int,
            grad_bytes: int = FP32_BYTES, fp32_grad_copy: bool = False, moment_bytes: int = FP32_BYTES) -> Recipe:
    moments = moment_bytes * (2 if optimizer == "adamw" else 1)  # AdamW: two moments; SGD: one momentum
    shards = dict(shard_grads=zero_stage >= 2, shard_optimizer=zero_stage >= 1,
                  shard_params=zero_stage >= (2 if traits.zero2_shards_params else 3))
    grad = (grad_bytes if not traits.fp32_params else FP32_BYTES) if traits.fp32_grads else dtype_bytes
    grad += FP32_BYTES if fp32_grad_copy else 0
    if traits.fp32_params:  # the fp32 parameters are the master weights
        return Recipe(FP32_BYTES, grad, moments, **shards)
    master = FP32_BYTES if dtype_bytes < FP32_BYTES else 0
    return Recipe(dtype_bytes, grad, master + moments, **shards)
