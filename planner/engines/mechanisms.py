"""The mechanisms an engine is built from, each written once and named after what implements it.

An engine (planner.engines.base.Engine) is one choice per concern: how data
parallelism stores and syncs state, how tensor, pipeline and context
parallelism move tensors, how the loss and the model's code keep their
tensors, how experts run. Engines that share a mechanism share the instance
(meshplan's executor and torchtitan both run DTensor TP and
torch.distributed.pipelining), so a behaviour two engines share is stated in
one place; the memory model (planner.memory) and the simulator
(planner.simulate) read the fields, never an engine's name.

Every field is read by planner.memory or planner.simulate, and each one is the
documented behaviour of the code named in its instance's comment.
"""

from __future__ import annotations

from dataclasses import dataclass

from topologies.errors import PlanError

# torch DDP's bucket_cap_mb default (25 MiB): gradients are reduced bucket by bucket, and the last
# bucket cannot overlap any backward compute (also the published engines' one bucket of buffers)
DDP_BUCKET_BYTES = 25 << 20

PIPE_P2P = ("overlapped", "exchange", "exchange-whole-grads")
CP_ROTATE = ("ring", "allgather")
GRAD_STORAGE = ("fp32", "grad_dtype", "dtype")
LOSS_KINDS = ("dtensor", "torch-loss-parallel", "megatron", "vocab-parallel")
FUSED_LOSS = ("", "transformer-engine", "compile")


@dataclass(frozen=True)
class DataParallel:
    """How parameters, gradients and optimizer state are stored, and how gradients are synced.

    phased: the memory peak is the largest phase of a step, tensors freed
    between phases as PyTorch frees them (planner.memory.phases, checked
    against torch's memory tracker); else every state and buffer is counted
    at once, the papers' accounting of engines with persistent contiguous
    gradient buffers. The data-parallel path of a layout (DDP, FSDP2, ...)
    is the engine's rule (Engine.dp_path).
    """

    name: str
    phased: bool
    master_params: bool  # parameters stored in fp32 are the optimizer's master weights, cast for compute
    grads: str  # what gradients are kept in (GRAD_STORAGE): fp32, the training's grad_dtype, or the compute dtype
    zero2_shards_params: bool  # ZeRO-2 keeps the parameter storage sharded between steps (FSDP2)
    overlaps_backward: bool  # the gradient reduction runs under the last micro-batch's backward
    # ZeRO-1 hands whole tensors, largest first, to the least-loaded rank (torch's ZeroRedundancyOptimizer)
    zero1_whole_tensors: bool = False
    # DeepSpeed's BF16_Optimizer under bf16 and ZeRO 0/1 (precision.bf16_optimizer_runs): fp32 gradient
    # accumulators beside the bf16 gradients, unsharded under ZeRO-1, and a per-micro-batch fold into them
    # (precision.BF16_OPTIMIZER_FOLD_BYTES, planner.simulate.grad_fold)
    bf16_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.grads not in GRAD_STORAGE:
            raise PlanError(f"DataParallel.grads must be one of {GRAD_STORAGE}, got {self.grads!r}")


# PyTorch's own: DDP (gradient_as_bucket_view=False), FSDP2's fully_shard and replicate, with fp32
# parameters cast by autocast or MixedPrecisionPolicy; gradients set to None after every step
TORCH_DATA_PARALLEL = DataParallel("torch", phased=True, master_params=True, grads="fp32", zero2_shards_params=True,
                                   overlaps_backward=True)
# meshplan's executor adds ZeRO-1 as torch's ZeroRedundancyOptimizer (executor.components.zero1)
TORCH_ZERO_REDUNDANCY = DataParallel("torch+zero-redundancy-optimizer", phased=True, master_params=True, grads="fp32",
                                     zero2_shards_params=True, overlaps_backward=True, zero1_whole_tensors=True)
# Megatron-Core's DistributedDataParallel: bf16 parameters, main gradients in a persistent contiguous
# buffer (grad_reduce_in_fp32: the training's grad_dtype), fp32 master weights in the distributed
# optimizer (ZeRO-1), bucketed reduce-scatters under the backward (--overlap-grad-reduce, 2023-08)
MEGATRON_DDP = DataParallel("megatron-ddp", phased=False, master_params=False, grads="grad_dtype",
                            zero2_shards_params=False, overlaps_backward=True)
# Megatron-LM before its DDP class (2023-08): --DDP-impl local all-reduces after forward_backward_func
MEGATRON_LOCAL_DDP = DataParallel("megatron-local-ddp", phased=False, master_params=False, grads="grad_dtype",
                                  zero2_shards_params=False, overlaps_backward=False)
# DeepSpeed's engine: gradients in the compute dtype, its BF16_Optimizer under bf16 and ZeRO 0/1, the
# pipeline engine reducing after its last backward
DEEPSPEED_ZERO = DataParallel("deepspeed-zero", phased=False, master_params=False, grads="dtype",
                              zero2_shards_params=False, overlaps_backward=False, bf16_optimizer=True)


@dataclass(frozen=True)
class TensorParallel:
    """How tensor parallelism splits layers and keeps their tensors."""

    name: str
    # sequence parallel saves the all-gathered projection inputs for the backward (DTensor's
    # PrepareModuleInput); else it saves the shards and gathers again in the backward
    saves_gathered_inputs: bool
    splits_tied_vocab: bool  # a tied embedding/output matrix is split by t like an untied one
    # the backward's input-gradient all-reduce runs under the weight-gradient GEMM
    # (Megatron-LM --async-tensor-model-parallel-allreduce, from 16c90445e7 of 2021-09-02)
    backward_overlap: bool


# torch.distributed.tensor.parallel: ColwiseParallel/RowwiseParallel with PrepareModuleInput, the tied
# embedding left replicated (meshplan's executor, torchtitan), collectives in line
DTENSOR = TensorParallel("dtensor", saves_gathered_inputs=True, splits_tied_vocab=False, backward_overlap=False)
# Megatron's ColumnParallelLinear/RowParallelLinear and VocabParallelEmbedding
MEGATRON_TP = TensorParallel("megatron", saves_gathered_inputs=False, splits_tied_vocab=True, backward_overlap=True)
MEGATRON_TP_2021 = TensorParallel("megatron-2021", saves_gathered_inputs=False, splits_tied_vocab=True,
                                  backward_overlap=False)


@dataclass(frozen=True)
class Loss:
    """How the output layer and the cross entropy keep their tensors (planner.memory.activations).

    kind (LOSS_KINDS) under tensor parallelism, logits split over the vocabulary:
    "dtensor": DTensor's loss_parallel as meshplan's executor runs it: the
      same bytes as "torch-loss-parallel" (validate-memory, Llama 3 8B at
      TP 4 x FSDP 16 under a fake mode of its own, as in a real run);
    "torch-loss-parallel": loss_parallel as torch runs it alone (torchtitan):
      the fp32 log-probabilities saved (4 B per local logit) and its fused
      nll_loss + log_softmax backward's three fp32 tensors beside them;
    "megatron": vocab_parallel_cross_entropy casts the logits to fp32 once and
      turns that saved buffer into the gradient in place;
    "vocab-parallel": the same loss with the fp32 gradient counted apart.
    fused: what the training's fused loss is on this engine (FUSED_LOSS):
    "transformer-engine" runs TE's parallel_cross_entropy when the recipe asks
    (TrainingSpec.fused_cross_entropy): the forward writes the gradient into the
    compute-dtype logits it saves; "compile" compiles the loss with the blocks
    whenever the training compiles: the compute-dtype logits and gradient.
    """

    kind: str
    fused: str = ""

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS or self.fused not in FUSED_LOSS:
            raise PlanError(f"Loss must be one of {LOSS_KINDS} with fused one of {FUSED_LOSS}, got "
                            f"{self.kind!r}, {self.fused!r}")


@dataclass(frozen=True)
class Pipeline:
    """How activations and their gradients cross a pipeline boundary, and what a stage keeps.

    p2p (PIPE_P2P): "overlapped": one transfer per direction that only delays
    its consumer (Megatron's batched isend/irecv, torch.distributed.pipelining);
    "exchange": DeepSpeed's PipelineEngine, where every step of its
    TrainSchedule opens with a blocking exchange with one neighbour (send the
    activation then receive the gradient, or the reverse), which holds both
    stages; with tp > 1 each tensor crosses split over the tp ranks
    (PartitionedTensor, 1/t per rank) and is all-gathered over tp where it is
    used; "exchange-whole-grads": the same before DeepSpeed 0.5.4 (2021-09-29):
    gradients cross whole (t times the bytes of a split one) and the sender
    all-gathers its split output back for the backward.
    """

    name: str
    p2p: str
    # torch.distributed.pipelining keeps each in-flight micro-batch's stage output for its backward and one
    # receive buffer per micro-batch for a non-first stage's input and a non-last stage's output gradient
    # (planner.memory.boundary; the buffers made for every micro-batch at the first step and kept,
    # pytorch/pytorch#136380); else one send and one receive buffer
    stage_outputs: bool
    # full recomputation also recomputes the model's ends (embedding, tied output layer): DeepSpeed's
    # PipelineModule before 0.5.4 checkpointed every module with parameters (activation_checkpoint_interval)
    recomputes_ends: bool = False
    # 1F1B-like schedules need at least pp micro-batches a step (torch.distributed.pipelining's schedules
    # refuse fewer); Megatron's 1F1B warms up min(pp - rank - 1, micro-batches) and DeepSpeed's TrainSchedule
    # runs any count, with a larger bubble
    needs_pp_microbatches: bool = False

    def __post_init__(self) -> None:
        if self.p2p not in PIPE_P2P:
            raise PlanError(f"Pipeline.p2p must be one of {PIPE_P2P}, got {self.p2p!r}")


TORCH_PIPELINING = Pipeline("torch.distributed.pipelining", p2p="overlapped", stage_outputs=True,
                            needs_pp_microbatches=True)
MEGATRON_PIPELINE = Pipeline("megatron", p2p="overlapped", stage_outputs=False)
# DeepSpeed's PipelineEngine from 0.5.4 (PartitionedTensor for activations and gradients)
DEEPSPEED_PIPELINE = Pipeline("deepspeed", p2p="exchange", stage_outputs=False)
# ... before 0.5.4: gradients sent whole over 2-rank broadcast groups, every module with parameters
# checkpointed (from 0.5.4 only ParallelTransformerLayerPipe for GPTModelPipe)
DEEPSPEED_PIPELINE_2021 = Pipeline("deepspeed-2021", p2p="exchange-whole-grads", stage_outputs=False,
                                   recomputes_ends=True)


@dataclass(frozen=True)
class ContextParallel:
    """How context parallelism moves K/V (time: planner.simulate; buffers: planner.memory.estimate).

    rotate (CP_ROTATE): "ring": cp - 1 point-to-point steps, each hidden under
    the whole attention core (Transformer Engine's p2p ring, Megatron's default
    cp_comm_type); "allgather": PyTorch's context_parallel with its default
    rotate method: one K/V all-gather hidden only under the first of cp SDPA
    calls, fp32 output merges, a re-gather and fp32 dK/dV sends in the
    backward (planner.simulate.context).
    """

    name: str
    rotate: str
    gathers_kv: bool  # the whole sequence's K/V is the exchange buffer (all-gather); else a ring's two chunks
    # autograd saves the all-gathered K/V for the attention's backward (meshplan's executor:
    # executor.parallel.context gathers outside the kernel); torch's context_parallel saves the local
    # shards and gathers again in the backward
    saves_gathered: bool = False

    def __post_init__(self) -> None:
        if self.rotate not in CP_ROTATE:
            raise PlanError(f"ContextParallel.rotate must be one of {CP_ROTATE}, got {self.rotate!r}")


TE_P2P_RING = ContextParallel("transformer-engine-p2p", rotate="ring", gathers_kv=False)
TORCH_CONTEXT_PARALLEL = ContextParallel("torch-context-parallel", rotate="allgather", gathers_kv=True)
# meshplan's executor: one K/V all-gather before SDPA, saved for the backward; its time is priced as a
# ring hidden under the attention core (the executor issues the gather before attention, not timed apart)
EXECUTOR_KV_ALL_GATHER = ContextParallel("executor-kv-all-gather", rotate="ring", gathers_kv=True,
                                         saves_gathered=True)


@dataclass(frozen=True)
class ModelCode:
    """What the engine's transformer code keeps, where it differs between engines (planner.memory)."""

    name: str
    # fp32 RoPE tables of the full context as module buffers (meshplan's executor: rope_cos/rope_sin)
    rope_buffers: bool = False
    # one fused SwiGLU kernel saves its 2f-wide input only: 3f kept, not 4f (Megatron-Core's bias_swiglu)
    fused_swiglu: bool = False
    # the final RMSNorm runs eagerly (torchtitan compiles each block, not the model's ends; its RMSNorm
    # normalizes an fp32 copy of the input): the copy and the normalized output are saved
    eager_final_norm: bool = False
    # GQA's K/V heads repeated to the query heads before SDPA (torchtitan's Llama repeat_kv, through
    # ff0829c10 of 2026-01-27): context parallelism moves and gathers query-wide K/V
    repeats_kv: bool = False


MESHPLAN_MODEL = ModelCode("executor.model", rope_buffers=True)
MEGATRON_MODEL = ModelCode("megatron", fused_swiglu=True)
MEGATRON_DEEPSPEED_MODEL = ModelCode("megatron-deepspeed")


@dataclass(frozen=True)
class Experts:
    """How routed experts run, where it changes memory (planner.memory)."""

    name: str
    # meshplan's MoE executor (executor.moe, executor.parallel.expert): routed experts as FSDP2 units of
    # their own sharded over dp_shard x cp / ep (whole over tp, whose ranks all run them), int64 routing
    # indices kept, the all-to-all outputs the saved expert inputs/outputs (no separate dispatch buffers);
    # measured with PyTorch's tracker (validate-memory, debug-moe ep 2)
    executor_experts: bool = False
    # the router's probabilities weigh the experts' activation (Megatron-Core >= 0.13 TEGroupedMLP,
    # permuted_probs), so the combine only unpermutes and no expert output is kept for it
    probs_in_experts: bool = False


EXECUTOR_EXPERTS = Experts("executor.moe", executor_experts=True)
GROUPED_EXPERTS = Experts("grouped")
MEGATRON_EXPERTS_PROBS = Experts("megatron-0.13", probs_in_experts=True)


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
