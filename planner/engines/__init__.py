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

Modules: `traits` (TimeTraits, MemoryTraits, the precision recipe), `registry`
(Engine, the four engines, the older releases' traits, executor_refusal),
`refusals` (what the executor does not build, rule by rule, and the module
lists an engine refuses). Everything is imported from here.
(fp16 on GPUs runs with dynamic loss scaling: executor.components.optim.build_scaler.)
"""

from planner.engines.registry import (
    DEEPSPEED_BF16_FOLD_BYTES,
    DEEPSPEED_PIPE_2021,
    DEEPSPEED_PIPE_2022,
    ENGINE_NAMES,
    ENGINES,
    MEGATRON_DEEPSPEED_2022,
    TE_FP8,
    TORCHAO_FP8,
    Engine,
    dp_path,
    executor_refusal,
    get_engine,
)
from planner.engines.traits import (
    DDP_BUCKET_BYTES,
    FP32_BYTES,
    NO_SMS,
    PIPE_P2P,
    TE_UB_DEFAULT,
    CommSms,
    Fp8Recipe,
    MemoryTraits,
    Recipe,
    TimeTraits,
    TpOverlapSms,
    bf16_optimizer_runs,
    fp8_rowwise_bytes,
)

__all__ = ["DDP_BUCKET_BYTES", "DEEPSPEED_BF16_FOLD_BYTES", "DEEPSPEED_PIPE_2021", "DEEPSPEED_PIPE_2022",
           "ENGINES", "ENGINE_NAMES", "FP32_BYTES", "MEGATRON_DEEPSPEED_2022", "NO_SMS", "PIPE_P2P", "TE_FP8",
           "TE_UB_DEFAULT", "TORCHAO_FP8", "CommSms", "Engine", "Fp8Recipe", "MemoryTraits", "Recipe", "TimeTraits",
           "TpOverlapSms", "bf16_optimizer_runs", "dp_path", "fp8_rowwise_bytes", "executor_refusal", "get_engine"]
