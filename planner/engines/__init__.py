"""Engines: everything engine-specific, one module per training stack, each with its releases.

An engine is the software that runs the step: meshplan's own executor
(PyTorch FSDP2/DDP/DTensor), Megatron (Megatron-LM, Megatron-Core: what NeMo
and Megatron-Bridge run), torchtitan, or DeepSpeed's pipeline engine with
Megatron-DeepSpeed. `--engine NAME@RELEASE` picks one release
(`torchtitan@2025-06`, `megatron@core-0.16`); a bare name is the newest
release modelled.

How to read one: `base.Engine` is the interface the search, planner.memory,
planner.simulate and the exporters call (what the search may propose, which
mechanism runs each concern, the layout-dependent rules: data-parallel path,
autocast, bytes per parameter, attention kernel, TP-overlap SMs, fused loss,
refusals). `mechanisms` holds the mechanisms, each written once and shared by
the engines that run it; `precision` the precision recipes; each stack's module
(`meshplan`, `torchtitan`, `megatron`, `deepspeed`) builds its releases from a
changelog (`releases.Change`: what changed, since which release, from which
commit). `registry` resolves names; `refusals` lists what meshplan's executor
does not build. meshplan's executor imports `dp_path`, `autocast` and
`refusal` from here, so a plan for `--engine meshplan` is one
`meshplan execute` runs.
(fp16 on GPUs runs with dynamic loss scaling: executor.components.optim.build_scaler.)
"""

from planner.engines.base import Engine
from planner.engines.mechanisms import (
    DDP_BUCKET_BYTES,
    NO_SMS,
    TE_UB_DEFAULT,
    CommSms,
    ContextParallel,
    DataParallel,
    Experts,
    Loss,
    ModelCode,
    Pipeline,
    TensorParallel,
    TpOverlapSms,
)
from planner.engines.meshplan import executor_dp_path, executor_refusal
from planner.engines.precision import (
    BF16_OPTIMIZER_FOLD_BYTES,
    FP32_BYTES,
    TE_FP8,
    TORCHAO_FP8,
    Fp8Recipe,
    Recipe,
    bf16_optimizer_runs,
    fp8_rowwise_bytes,
)
from planner.engines.registry import (
    ENGINE_CHOICES,
    ENGINE_NAMES,
    ENGINES,
    engine_name,
    get_engine,
    newest,
    releases_help,
)

__all__ = ["BF16_OPTIMIZER_FOLD_BYTES", "DDP_BUCKET_BYTES", "ENGINES", "ENGINE_CHOICES", "ENGINE_NAMES", "FP32_BYTES",
           "NO_SMS", "TE_FP8", "TE_UB_DEFAULT", "TORCHAO_FP8", "CommSms", "ContextParallel", "DataParallel", "Engine",
           "Experts", "Fp8Recipe", "Loss", "ModelCode", "Pipeline", "Recipe", "TensorParallel", "TpOverlapSms",
           "bf16_optimizer_runs", "engine_name", "executor_dp_path", "executor_refusal", "fp8_rowwise_bytes",
           "get_engine", "newest", "releases_help"]
