"""The engines: one Engine per stack (meshplan, megatron, torchtitan, deepspeed) and what each refuses.

Engine bundles a stack's traits (planner.engines.traits) with the recompute
kinds and options it implements; the releases older steps ran on (the 2021-22
Megatron-LM and DeepSpeed pipelines) are TimeTraits constants here beside the
engines that use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines.refusals import fp8_refusal, recompute_modules_refusal, unbuilt_features
from planner.engines.traits import (
    FP32_BYTES,
    TE_UB_DEFAULT,
    Fp8Recipe,
    MemoryTraits,
    Recipe,
    TimeTraits,
    bf16_optimizer_runs,
    precision_recipe,
)
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec
from topologies.errors import PlanError


@dataclass(frozen=True)
class Engine:
    """One engine's traits, precision recipe and (for meshplan) executor rules."""

    name: str
    time: TimeTraits
    memory: MemoryTraits
    executes: bool  # `meshplan execute` runs its plans; others are exported
    fp8: Fp8Recipe = Fp8Recipe(False, False, False)
    recompute_kinds: tuple[str, ...] = ("none", "selective", "full")  # lightest first
    compiles: bool = False  # --compile (torch.compile per block) means something for this engine
    partial_recompute: bool = False  # full recomputation of N layers per chunk (Layout.recompute_layers)
    # selective recomputation of named modules (Layout.recompute_modules: Megatron-Core's --recompute-modules)
    recompute_modules: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # data-parallel sharding the engine implements
    # pipeline schedules it runs with pp > 1 (torch.distributed.pipelining has all four; Megatron-Core's
    # get_forward_backward_func 1F1B with or without interleaving; DeepSpeed's PipelineEngine its TrainSchedule)
    pp_schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")
    # the highest ZeRO stage it runs with pp > 1 (DeepSpeed's PipelineEngine asserts ZeRO < 2)
    pipeline_zero_max: int = 3
    # what it stores the optimizer's moments in (TrainingSpec.optimizer_dtype): fp32, or 16 bits where
    # it has a precision-aware optimizer (Megatron-Core's --exp-avg-dtype / --exp-avg-sq-dtype)
    optimizer_dtypes: tuple[str, ...] = ("fp32",)
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
               dtype: str = "", moment_bytes: int = FP32_BYTES) -> Recipe:
        """grad_bytes: the training's grad_dtype, which sets the gradient buffers of engines that keep
        16-bit parameters with separate main gradients (Megatron's grad_reduce_in_fp32 off: 2 bytes);
        dtype: the compute dtype's name (bf16 turns on DeepSpeed's BF16_Optimizer); moment_bytes: the
        training's optimizer_dtype (16-bit moments under Megatron's precision-aware optimizer)."""
        fp32_copy = self.memory.bf16_fp32_grads and bf16_optimizer_runs(dtype, zero_stage)
        return precision_recipe(self.memory, dtype_bytes, optimizer, zero_stage, grad_bytes, fp32_copy, moment_bytes)

    def refusal(self, model: ModelSpec, layout: Layout, dtype: str, on_gpu: bool,
                training: TrainingSpec | None = None) -> str | None:
        """Why this engine's plans cannot hold `layout` (unsupported recompute kinds, meshplan's executor)."""
        if layout.recompute not in self.recompute_kinds:
            return (f"engine {self.name} does not implement recompute {layout.recompute!r}; it has "
                    f"{', '.join(self.recompute_kinds)}")
        modules = recompute_modules_refusal(self.name, self.recompute_modules, model, layout, training)
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
        if layout.pp > 1 and layout.pp_schedule not in self.pp_schedules:
            return (f"engine {self.name} pipelines with {', '.join(self.pp_schedules)} only, got pp_schedule "
                    f"{layout.pp_schedule!r} (pp {layout.pp}); pin --pp-schedule {self.pp_schedules[-1]} or plan "
                    "with --engine meshplan or torchtitan")
        if layout.pp > 1 and layout.zero_stage > self.pipeline_zero_max:
            return (f"engine {self.name} runs ZeRO 0-{self.pipeline_zero_max} with pipeline parallelism, got "
                    f"ZeRO-{layout.zero_stage} with pp {layout.pp}; pin --zero {self.pipeline_zero_max} or --pp 1")
        if training is not None and training.fp8_params and not self.fp8.primary_weights:
            return (f"engine {self.name} keeps 16-bit weights under {training.precision} (fp8_params asks for "
                    "8-bit parameters, Transformer Engine's); plan without fp8_params, or with --engine megatron")
        if training is not None and training.fused_cross_entropy and not self.memory.fused_cross_entropy:
            return (f"engine {self.name} has no fused cross entropy that keeps only the compute-dtype logits "
                    "(fused_cross_entropy); plan without it, or with --engine megatron")
        if training is not None and training.fused_cross_entropy and self.memory.compiled_cross_entropy \
                and not training.compile:
            return (f"engine {self.name} fuses the loss only by compiling it with the blocks (fused_cross_entropy "
                    "without compile); plan with --compile, or without fused_cross_entropy")
        if training is not None and training.optimizer_dtype not in self.optimizer_dtypes:
            return (f"engine {self.name} keeps the optimizer's moments in {', '.join(self.optimizer_dtypes)}, got "
                    f"optimizer_dtype {training.optimizer_dtype}; plan with fp32, or with --engine megatron "
                    "(its precision-aware optimizer)")
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

    def fp8_weight_bytes(self, training: TrainingSpec, any_layout: bool = True) -> float:
        """Persistent 8-bit weight bytes per block-linear parameter under this training's precision, on a GPU
        whose FP8 GEMMs take any operand layout or not (GPUSpec.fp8_any_layout; Fp8Recipe.weight_bytes)."""
        return self.fp8.weight_bytes(training.precision, any_layout) if training.fp8 else 0.0

    def fp8_primary_weights(self, training: TrainingSpec) -> bool:
        """The block-linear parameters are the 8-bit tensors themselves (no 16-bit weights kept)."""
        return training.fp8 and training.fp8_params and self.fp8.primary_weights


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
# Transformer Engine (megatron), read in TE 1.8 and 2.8 (module/linear.py, module/base.py
# get_weight_workspace): without 8-bit parameters the weight is cast into a workspace cached
# under the name "weight" whenever Megatron-Core passes is_first_microbatch (TELinear does unless
# disable_parameter_transpose_cache), so it lives between micro-batches and steps beside the bf16
# weight, with the usages the backward needs: the row-wise data, and a column-wise copy for the
# input-gradient GEMM on TN-only GPUs (Hopper) and always under MXFP8 (Fp8Recipe.weight_bytes).
# With --fp8-param-gather (Megatron-Bridge's fp8 and mxfp8 recipes, NeMo 2.0's
# bf16_with_fp8_mixed: TrainingSpec.fp8_params) those 8-bit tensors are the parameters: the
# distributed optimizer's parameter buffer is uint8 (param_and_grad_buffer.group_params_for_buffers),
# the fp32 master stays in the optimizer, and no bf16 weight exists; on Hopper TE keeps the
# transpose on the parameter after each all-gather (post_all_gather_processing). te.Linear saves
# its fp8-cast input for the backward (column-wise usage only: linear.py drops the row-wise data
# before saving). torchao float8 (torchtitan): Float8Linear casts in the forward and saves the
# high-precision input and weight, recasting in the backward (no persistent
# copy); with FSDP2 torchtitan gathers the weights in float8
# (enable_fsdp_float8_all_gather, which its float8 recipes turn on).
TE_FP8 = Fp8Recipe(weight_copy=True, saves_fp8_inputs=True, fp8_all_gather=False, primary_weights=True)
TORCHAO_FP8 = Fp8Recipe(weight_copy=False, saves_fp8_inputs=False, fp8_all_gather=True)
ENGINES: dict[str, Engine] = {
    "meshplan": Engine(
        "meshplan", TimeTraits(fused_attention=True, overlap_dp=True),
        MemoryTraits(vocab_parallel_loss=True, tied_vocab_parallel=False, ddp_bucket_copy=True, fsdp_root_unit=False,
                     step_phases=True, rope_buffers=True, zero1_whole_tensors=True, sp_saves_gathered=True,
                     fp32_params=True, fp32_grads=True, zero2_shards_params=True, dtensor_loss_parallel=True,
                     executor_experts=True, cp_all_gather=True, cp_saves_gathered=True,
                     pp_stage_outputs=True),
        executes=True, fp8=TORCHAO_FP8, recompute_kinds=("none", "selective", "op", "full"), compiles=True),
    "megatron": Engine("megatron", TimeTraits(fused_attention=True, overlap_dp=True, overlap_tp_backward=True,
                                              tp_overlap_sms=TE_UB_DEFAULT),
                       MemoryTraits(fp32_grads=True, fused_swiglu=True, moe_probs_in_experts=True,
                                    activation_offload=True,
                                    inplace_loss_backward=True, fused_cross_entropy=True, **_PUBLISHED_MEMORY),
                       executes=False, fp8=TE_FP8, partial_recompute=True, recompute_modules=True,
                       pp_schedules=("1f1b", "interleaved-1f1b"), optimizer_dtypes=("fp32", "bf16", "fp16"),
                       eager_time=MEGATRON_DEEPSPEED_2022,
                       cp_needs_fused=True, async_tp_option="--tp-comm-overlap"),
    # torchtitan (PyTorch-native): FSDP2 fully_shard per block with bf16 params/fp32 reduce,
    # DTensor TP with loss parallel (logits stay split into the loss), PrepareModuleInput sequence
    # parallel (saves gathered inputs), SDPA (fused) attention, per-op SAC ("op") or whole-block
    # ("full") checkpointing, torch.compile per block, torchao float8. Its rotary table is a
    # complex buffer that FSDP2 does not cast, so no per-block copies. Its loss is DTensor's
    # loss_parallel under TP (fused backward: planner.memory.activations), its pipeline
    # torch.distributed.pipelining's PipelineStage, whose per-micro-batch receive buffers and
    # kept stage outputs were already those of planner.memory.boundary in late 2024 (the
    # buffers made for every micro-batch at the first step and kept, pytorch/pytorch#136380).
    "torchtitan": Engine(
        "torchtitan", TimeTraits(fused_attention=True, overlap_dp=True, cp_rotate="allgather", sdpa_repeats_kv=True),
        MemoryTraits(vocab_parallel_loss=True, tied_vocab_parallel=False, ddp_bucket_copy=False, fsdp_root_unit=True,
                     step_phases=True, rope_buffers=False, zero1_whole_tensors=False, sp_saves_gathered=True,
                     fp32_params=True, fp32_grads=True, zero2_shards_params=True,
                     cp_all_gather=True, fused_loss_parallel_backward=True,
                     pp_stage_outputs=True, fused_cross_entropy=True, compiled_cross_entropy=True,
                     eager_final_norm=True),
        executes=False, fp8=TORCHAO_FP8, recompute_kinds=("none", "op", "full"), compiles=True, cp_needs_fused=True,
        zero_stages=(0, 2, 3),  # DDP / replicate, FSDP2 without or with resharding after forward
        async_tp_option="enable_async_tensor_parallel", async_tp_needs_compile=True),
    "deepspeed": Engine("deepspeed", DEEPSPEED_PIPE_2022,
                        MemoryTraits(fp32_grads=False, bf16_fp32_grads=True, **_PUBLISHED_MEMORY), executes=False,
                        pp_schedules=("1f1b",), pipeline_zero_max=1),
}
ENGINE_NAMES = tuple(ENGINES)


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


def executor_refusal(model: ModelSpec, layout: Layout, dtype: str = "bf16", on_gpu: bool = True,
                     training: TrainingSpec | None = None) -> str | None:
    """Why meshplan's executor cannot run this layout (one sentence with the values), or None."""
    if training is not None and training.fp8:
        reason = fp8_refusal(model, layout, training, on_gpu)
        if reason:
            return reason
    unbuilt = unbuilt_features(model)
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
    if layout.zero_stage == 1 and layout.dp_shard == 1:
        return (f"ZeRO-1 over the cp ranks alone (dp_shard 1, cp {layout.cp}): the executor's ZeRO-1 shards over "
                "dp_shard; plan with --zero 2 or 3 (FSDP over dp_shard x cp) or a larger --dp-shard")
    if layout.offload != "none" and not (layout.offload == "optimizer+params" and layout.zero_stage == 3):
        return (f"offload {layout.offload!r} with zero_stage {layout.zero_stage}: the executor offloads only "
                "'optimizer+params' under ZeRO-3 (FSDP2 CPUOffloadPolicy); plan with offload none")
    return None
