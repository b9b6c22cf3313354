"""DeepSpeed (microsoft/DeepSpeed) with Megatron-DeepSpeed's model: the PipelineEngine stack, by release.

Megatron-DeepSpeed on DeepSpeed's PipelineEngine (deepspeed/runtime/pipe):
Megatron's tensor parallelism and eager softmax attention, gradients in the
compute dtype reduced after the last backward (under bf16 and ZeRO 0/1
through its BF16_Optimizer: fp32 accumulators and a per-micro-batch fold,
planner.engines.mechanisms.DEEPSPEED_ZERO), pipeline boundaries as blocking
exchanges (its TrainSchedule, otherwise 1F1B), ZeRO 0/1 under pipelining.

Releases: `0.5.3` (DeepSpeed before 0.5.4 with the Megatron-DeepSpeed fork
of 2021, as MT-NLG 530B ran it: Smith et al. 2022) and `0.6` (2022).
MT-NLG trained in bf16 on the 2021 stack, with no public bf16 pipeline path;
the first DeepSpeed published (BF16_Optimizer, "bf16+pipeline parallelism",
PR 1801, 2022) is priced for both releases.
"""

from __future__ import annotations

from planner.engines.base import Engine
from planner.engines.mechanisms import (
    DEEPSPEED_PIPELINE,
    DEEPSPEED_PIPELINE_2021,
    DEEPSPEED_ZERO,
    GROUPED_EXPERTS,
    MEGATRON_DEEPSPEED_MODEL,
    MEGATRON_TP,
    MEGATRON_TP_2021,
    TE_P2P_RING,
    Loss,
)
from planner.engines.releases import Change, Release, build_releases

_BASE = Engine(
    "deepspeed", "", "", data_parallel=DEEPSPEED_ZERO, tensor_parallel=MEGATRON_TP_2021, loss=Loss("vocab-parallel"),
    pipeline=DEEPSPEED_PIPELINE_2021, context_parallel=TE_P2P_RING, model_code=MEGATRON_DEEPSPEED_MODEL,
    experts=GROUPED_EXPERTS, attention="eager", recompute_kinds=("none", "full"), pp_schedules=("1f1b",),
    pipeline_zero_max=1, sequence_parallel=False, context_parallel_runs=False,
    # ZeRO-Offload (0.3.0, 2020: zero_optimization.offload_optimizer) and ZeRO-Infinity (0.3.15, 2021:
    # offload_param, stage 3 only), both before the first release modelled here
    offload_kinds=("none", "optimizer", "optimizer+params"), lora="peft")

RELEASES: dict[str, Engine] = build_releases(_BASE, (
    Release("0.5.3", "DeepSpeed 0.5.3 with Megatron-DeepSpeed of 2021 (MT-NLG 530B)"),
    Release("0.6", "DeepSpeed 0.6 with Megatron-DeepSpeed of 2022"),
), (
    Change("0.6", "DeepSpeed 0.5.4 of 2021-09-29 (PipelineEngine: PartitionedTensor gradients; only "
           "ParallelTransformerLayerPipe checkpointed for GPTModelPipe)",
           "gradients cross split over tp; full recomputation re-runs the blocks only",
           {"pipeline": DEEPSPEED_PIPELINE}),
    Change("0.6", "Megatron-DeepSpeed's sync with Megatron-LM of 2021-12-10",
           "the input-gradient TP all-reduce under the weight-gradient GEMM", {"tensor_parallel": MEGATRON_TP}),
    Change("0.6", "Megatron-DeepSpeed's 2022 syncs with Megatron-LM (sequence parallel, selective recomputation)",
           "sequence parallelism and selective recomputation",
           {"sequence_parallel": True, "recompute_kinds": ("none", "selective", "full")}),
))
