"""Engine: the interface the search, the memory model, the simulator and the exporters call.

One engine is one release of one training stack. It answers three kinds of
question:

* what the search may propose (`recompute_kinds`, `zero_stages`,
  `pp_schedules`, ... and `refusal`, the one sentence why a layout cannot run);
* which mechanism runs each concern (planner.engines.mechanisms: data
  parallelism, tensor, pipeline and context parallelism, the loss, the model
  code, the experts, the 8-bit recipe), read field by field by planner.memory
  and planner.simulate;
* the rules that depend on the layout: the data-parallel path a layout takes
  (`dp_path`), whether it trains under torch.autocast (`autocast`), the bytes
  per parameter (`recipe`), the attention kernel (`fused_attention`), the SMs
  overlapped TP collectives take (`tp_overlap_sms`), what the fused loss is
  (`fused_loss`).

Each stack's module (meshplan, torchtitan, megatron, deepspeed) builds its
releases from these and overrides the rules where its code differs; what
changed between releases is listed there, each change with its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines.mechanisms import (
    NO_SMS,
    ContextParallel,
    DataParallel,
    Experts,
    Loss,
    ModelCode,
    Pipeline,
    TensorParallel,
    TpOverlapSms,
)
from planner.engines.precision import (
    FP32_BYTES,
    NO_FP8,
    Fp8Recipe,
    Recipe,
    bf16_optimizer_runs,
    precision_recipe,
)
from planner.engines.refusals import recompute_modules_refusal
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec


@dataclass(frozen=True)
class Engine:
    """One release of one training stack (module docstring). Frozen and hashable: caches key on it."""

    name: str
    release: str
    summary: str  # one line: what this release is and where it was read
    data_parallel: DataParallel
    tensor_parallel: TensorParallel
    loss: Loss
    pipeline: Pipeline
    context_parallel: ContextParallel
    model_code: ModelCode
    experts: Experts
    fp8: Fp8Recipe = NO_FP8
    attention: str = "fused"  # the default kernel: fused (flash/cuDNN/TE) or eager (softmax over scores)
    tp_overlap_default: TpOverlapSms = NO_SMS  # SMs each overlapped TP collective takes without a recipe config
    # ---- what the search may propose
    recompute_kinds: tuple[str, ...] = ("none", "selective", "full")  # lightest first
    compiles: bool = False  # --compile (torch.compile per block) means something for this engine
    partial_recompute: bool = False  # full recomputation of N layers per chunk (Layout.recompute_layers)
    # selective recomputation of named modules (Layout.recompute_modules: Megatron-Core's --recompute-modules)
    recompute_modules: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # data-parallel sharding the engine implements
    # pipeline schedules it runs with pp > 1 (torch.distributed.pipelining has all four, and DualPipeV from torch
    # 2.9, which only torchtitan runs here; Megatron-Core's get_forward_backward_func 1F1B with or without
    # interleaving; DeepSpeed's PipelineEngine its TrainSchedule)
    pp_schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")
    # the highest ZeRO stage it runs with pp > 1 (DeepSpeed's PipelineEngine asserts ZeRO < 2)
    pipeline_zero_max: int = 3
    # what it stores the optimizer's moments in (TrainingSpec.optimizer_dtype): fp32, or 16 bits where
    # it has a precision-aware optimizer (Megatron-Core's --exp-avg-dtype / --exp-avg-sq-dtype)
    optimizer_dtypes: tuple[str, ...] = ("fp32",)
    sequence_parallel: bool = True  # it has sequence parallelism (Megatron-LM from 2022)
    # context parallelism runs only inside a fused attention kernel (Transformer Engine's
    # AttnFuncWithCP*, torch's ring attention over the SDPA flash/efficient/cuDNN ops; Megatron's
    # own DotProductAttention asserts cp == 1): eager attention with cp > 1 is refused
    cp_needs_fused: bool = False
    context_parallel_runs: bool = True  # it has context parallelism at all at this release
    # the engine's option that pipelines SP's all-gathers / reduce-scatters with their GEMMs
    # (TrainingSpec.async_tp; planner.simulate.tp_overlap); "" where it has none
    async_tp_option: str = ""
    async_tp_needs_compile: bool = False  # torchtitan applies it as an Inductor pass: torch.compile required
    activation_offload: bool = False  # N layers' activations to the host (Megatron-Core cpu_offloading, TE)
    # model state it keeps in host memory (Layout.offload; planner.simulate.offload prices them): "optimizer"
    # (DeepSpeed offload_optimizer, Megatron-Core --optimizer-cpu-offload), "optimizer+params" (DeepSpeed
    # offload_param with offload_optimizer, FSDP2's CPUOffloadPolicy)
    offload_kinds: tuple[str, ...] = ("none",)
    # named userbuffers configs the recipe option tp_overlap_cfg may pick (Engine.tp_overlap_sms)
    tp_overlap_configs: tuple[tuple[str, TpOverlapSms], ...] = ()
    # what trains LoRA adapters on a frozen base with this engine (TrainingSpec.finetune): "meshplan"
    # (executor.lora), "peft" (Hugging Face PEFT's LoRA layers on the transformers model the engine wraps);
    # "" where the engine trains every parameter
    lora: str = ""

    @property
    def label(self) -> str:
        """`name@release`, what --engine and plan.json name it by."""
        return f"{self.name}@{self.release}"

    # ---- rules that depend on the layout -----------------------------------------

    def dp_path(self, layout: Layout) -> str:
        """How this engine syncs gradients for `layout`: the PyTorch engines' "none", "ddp" (torch DDP),
        "replicate" (FSDP2's replicate) or "fsdp" (fully_shard), each priced phase by phase by
        planner.memory.phases; the others' own data-parallel mechanism by name, whose buffers
        planner.memory counts the papers' way."""
        return self.data_parallel.name

    def autocast(self, layout: Layout, dtype_bytes: int, frozen_base: bool = False) -> bool:
        """Mixed precision by torch.autocast: fp32 parameters cast op by op, for layouts whose gradients no
        FSDP2 module syncs (data-parallel path none or ddp, where no MixedPrecisionPolicy casts them).

        The one home of this rule: the memory model (saved weight copies, the fp32 residual stream) and
        meshplan's executor (executor.parallel.parallelize) both ask it. Engines that store 16-bit
        parameters never autocast, nor does a LoRA run (frozen_base: the base is stored in the compute dtype
        and the adapters cast their weights to their input's dtype, executor.lora)."""
        return (self.data_parallel.master_params and dtype_bytes < FP32_BYTES and not frozen_base
                and self.dp_path(layout) in ("none", "ddp"))

    def recipe(self, dtype_bytes: int, optimizer: str, zero_stage: int, grad_bytes: int = FP32_BYTES,
               dtype: str = "", moment_bytes: int = FP32_BYTES) -> Recipe:
        """Bytes per parameter. grad_bytes: the training's grad_dtype (main gradients of engines that keep
        16-bit parameters); dtype: the compute dtype's name (bf16 turns on DeepSpeed's BF16_Optimizer);
        moment_bytes: the training's optimizer_dtype."""
        dp = self.data_parallel
        fp32_copy = dp.bf16_optimizer and bf16_optimizer_runs(dtype, zero_stage)
        return precision_recipe(dp.master_params, dp.grads, dp.zero2_shards_params, dtype_bytes, optimizer,
                                zero_stage, grad_bytes, fp32_copy, moment_bytes)

    def fused_attention(self, training: TrainingSpec) -> bool:
        """The attention kernel a step runs: the training's `attention`, else this engine's default."""
        return training.fused_attention(self.attention == "fused")

    def fused_loss(self, training: TrainingSpec, layout: Layout) -> str:
        """The fused loss this step runs (mechanisms.FUSED_LOSS): Transformer Engine's when the recipe asks,
        the compiled loss when the training compiles (under TP, where the loss stays DTensor's
        loss_parallel, none), else ""."""
        fused = self.loss.fused
        if fused == "transformer-engine":
            return fused if training.fused_cross_entropy else ""
        if fused == "compile":
            return fused if training.compile and layout.tp == 1 else ""
        return ""

    def tp_overlap_sms(self, training: TrainingSpec) -> TpOverlapSms:
        """The SMs each overlapped TP collective takes under async TP: the recipe's named userbuffers
        config (TrainingSpec.tp_overlap_cfg), else the engine's default."""
        if training.tp_overlap_cfg:
            return dict(self.tp_overlap_configs)[training.tp_overlap_cfg]
        return self.tp_overlap_default

    def fp8_weight_bytes(self, training: TrainingSpec, any_layout: bool = True) -> float:
        """Persistent 8-bit weight bytes per block-linear parameter under this training's precision, on a GPU
        whose FP8 GEMMs take any operand layout or not (GPUSpec.fp8_any_layout; Fp8Recipe.weight_bytes)."""
        return self.fp8.weight_bytes(training.precision, any_layout) if training.fp8 else 0.0

    def fp8_primary_weights(self, training: TrainingSpec) -> bool:
        """The block-linear parameters are the 8-bit tensors themselves (no 16-bit weights kept)."""
        return training.fp8 and training.fp8_params and self.fp8.primary_weights

    # ---- what it cannot run ------------------------------------------------------

    def refusal(self, model: ModelSpec, layout: Layout, dtype: str, on_gpu: bool,
                training: TrainingSpec | None = None) -> str | None:
        """Why this engine cannot run `layout` (one sentence with the values and what to do), or None."""
        return self._common_refusal(model, layout, training)

    def microbatch_refusal(self, layout: Layout) -> str | None:
        """Why this engine's pipeline cannot run the layout's micro-batches per step (grad_accum_steps), or None.
        A rule on the whole layout, apart from `refusal`, which the search asks before the micro-batch is chosen
        (its counts are filtered by planner.search.candidates.pipeline_allows, the same rule)."""
        from planner.search.candidates import pipeline_allows

        if pipeline_allows(layout, layout.grad_accum_steps, self.pipeline.needs_pp_microbatches):
            return None
        if layout.pp_schedule == "dualpipev":
            return (f"dualpipev runs at least 2 x pp ({2 * layout.pp}) micro-batches per step (DualPipeV asserts it), "
                    f"got grad_accum_steps {layout.grad_accum_steps}: raise the global batch or lower the micro-batch")
        return (f"engine {self.label} runs pipeline schedule {layout.pp_schedule} with at least pp ({layout.pp}) "
                f"micro-batches per step, got grad_accum_steps {layout.grad_accum_steps}: raise the global batch or "
                "lower the micro-batch")

    def model_refusal(self, model: ModelSpec) -> str | None:
        """Why this engine cannot run `model` in any layout (a module it does not build), or None."""
        return None

    def _common_refusal(self, model: ModelSpec, layout: Layout, training: TrainingSpec | None) -> str | None:
        who = f"engine {self.label}"
        if layout.recompute not in self.recompute_kinds:
            return f"{who} does not implement recompute {layout.recompute!r}; it has {', '.join(self.recompute_kinds)}"
        modules = recompute_modules_refusal(self.label, self.recompute_modules, model, layout, training)
        if modules:
            return modules
        if layout.tp > 1 and layout.sequence_parallel and not self.sequence_parallel:
            return f"{who} has no sequence parallelism; plan with --no-sequence-parallel or a newer release"
        if layout.cp > 1 and not self.context_parallel_runs:
            return f"{who} has no context parallelism; plan with --cp 1 or a newer release"
        if layout.cp > 1 and self.cp_needs_fused and training is not None and not self.fused_attention(training):
            return (f"{who} runs context parallelism (cp {layout.cp}) only inside a fused attention "
                    "kernel; use --attention fused or --cp 1")
        if layout.activation_offload_layers and not self.activation_offload:
            return (f"{who} does not offload activations to the host (activation_offload_layers "
                    f"{layout.activation_offload_layers}); plan with 0, or with --engine megatron")
        offload = offload_refusal(who, self.offload_kinds, layout)
        if offload:
            return offload
        if layout.pp > 1 and layout.pp_schedule not in self.pp_schedules:
            runs = "torchtitan@2025-10 or newer" if layout.pp_schedule == "dualpipev" else "meshplan or torchtitan"
            return (f"{who} pipelines with {', '.join(self.pp_schedules)} only, got pp_schedule "
                    f"{layout.pp_schedule!r} (pp {layout.pp}); pin --pp-schedule {self.pp_schedules[-1]} or plan "
                    f"with --engine {runs}")
        if layout.pp > 1 and layout.zero_stage > self.pipeline_zero_max:
            return (f"{who} runs ZeRO 0-{self.pipeline_zero_max} with pipeline parallelism, got "
                    f"ZeRO-{layout.zero_stage} with pp {layout.pp}; pin --zero {self.pipeline_zero_max} or --pp 1")
        if training is not None:
            reason = self._training_refusal(layout, training)
            if reason:
                return reason
        if layout.zero_stage not in self.zero_stages:
            return f"{who} does not implement ZeRO-{layout.zero_stage}; it has ZeRO {', '.join(map(str, self.zero_stages))}"
        return None

    def _training_refusal(self, layout: Layout, training: TrainingSpec) -> str | None:
        who = f"engine {self.label}"
        if training.async_tp and (layout.tp == 1 or not layout.sequence_parallel):
            return (f"async TP pipelines the all-gathers and reduce-scatters of sequence parallelism: it needs "
                    f"tp > 1 with sequence parallel, got tp {layout.tp}"
                    f"{'' if layout.sequence_parallel else ' without sequence parallel'}; "
                    "allow --tp > 1 and --sequence-parallel, or drop --async-tp")
        if training.fp8 and not self.fp8.library:
            return f"{who} has no 8-bit GEMM recipe; plan with --precision bf16 or a newer release"
        if training.fp8_params and not self.fp8.primary_weights:
            return (f"{who} keeps 16-bit weights under {training.precision} (fp8_params asks for "
                    "8-bit parameters, Transformer Engine's); plan without fp8_params, or with --engine megatron")
        if training.fused_cross_entropy and self.loss.fused != "transformer-engine":
            other = (" (its loss is compiled with the blocks under --compile)" if self.loss.fused == "compile"
                     else "")
            return (f"{who} has no Transformer Engine cross entropy (fused_cross_entropy){other}; plan without "
                    "it, or with --engine megatron")
        if training.optimizer_dtype not in self.optimizer_dtypes:
            return (f"{who} keeps the optimizer's moments in {', '.join(self.optimizer_dtypes)}, got "
                    f"optimizer_dtype {training.optimizer_dtype}; plan with fp32, or with --engine megatron "
                    "(its precision-aware optimizer)")
        if training.lora and not self.lora:
            return (f"{who} trains every parameter (no LoRA adapters in its training loop), got finetune "
                    f"{training.finetune}; plan LoRA with --engine meshplan (or deepspeed, with PEFT's adapters), or "
                    "drop --finetune")
        if training.tp_overlap_cfg and training.tp_overlap_cfg not in dict(self.tp_overlap_configs):
            names = ", ".join(name for name, _ in self.tp_overlap_configs) or "none"
            return (f"{who} has no userbuffers config {training.tp_overlap_cfg!r} (tp_overlap_cfg); it knows: "
                    f"{names}")
        return None


def offload_refusal(who: str, kinds: tuple[str, ...], layout: Layout) -> str | None:
    """Offload the engine does not run, or under a ZeRO stage it does not run it with: optimizer offload
    steps each rank's shard of the optimizer on the host (DeepSpeed ZeRO 1-3, Megatron's distributed
    optimizer), parameter offload keeps each rank's parameter shard there between uses (ZeRO-3 only:
    DeepSpeed's offload_param, FSDP2's CPUOffloadPolicy with resharding)."""
    if layout.offload == "none":
        return None
    if layout.offload not in kinds:
        flags = {"optimizer": "optimizer", "optimizer+params": "params"}
        runs = ", ".join(flags[k] for k in kinds if k != "none") or "nothing"
        return (f"{who} does not offload {layout.offload!r} to the host (it offloads: {runs}); plan with "
                f"--offload {'none' if runs == 'nothing' else ' or '.join(['none', *runs.split(', ')])}, or "
                "--engine deepspeed (optimizer and params)")
    if layout.offload == "optimizer" and layout.zero_stage < 1:
        return ("optimizer offload steps each rank's shard on the host and needs ZeRO 1-3, got ZeRO-0; pin "
                "--zero 1, 2 or 3")
    if layout.offload == "optimizer+params" and layout.zero_stage != 3:
        if layout.dp_shard * layout.cp == 1:  # no ranks to shard over: ZeRO-3 is not a layout here
            fix = ("ZeRO-3 shards over data-parallel ranks and this layout has one; plan for more GPUs, or "
                   "fine-tune with --finetune lora")
        else:
            fix = "pin --zero 3"
        if "optimizer" in kinds:
            fix += ", or plan with --offload optimizer"
        return (f"parameter offload keeps each rank's parameter shard on the host between uses and needs ZeRO-3, "
                f"got ZeRO-{layout.zero_stage}; {fix}")
    return None
