"""torchtitan (pytorch/torchtitan): PyTorch-native pre-training, by release.

What every release modelled runs: FSDP2 fully_shard per block with bf16
parameters and fp32 reduction (HSDP over dp_replicate x dp_shard; context
parallelism folded into the shard mesh, dp_shard_cp), DTensor TP with
loss_parallel (logits stay split into the loss) and PrepareModuleInput
sequence parallel (saves the gathered inputs), SDPA attention, per-op
selective checkpointing ("op") or whole blocks ("full"), torch.compile per
block, torchao float8 with float8 all-gathers, torch.distributed.pipelining
(whose per-micro-batch receive buffers and kept stage outputs were already
those of planner.memory.boundary in late 2024), torch's context_parallel. Its
rotary table is a complex buffer that FSDP2 does not cast, so no per-block
copies; its final RMSNorm runs eagerly outside the compiled blocks.

How data parallelism without sharding runs changed over the releases
(`dp_impl`, read by `dp_path`, `refusal`):
  "ddp-fp32"     dp_replicate alone is classic DDP (composable replicate over
                 DistributedDataParallel, bucket_cap_mb 100, default
                 gradient_as_bucket_view=False: bucket copies of every
                 gradient); it refuses more than one mesh dimension ("DDP has
                 not supported > 1D parallelism"); mixed precision comes only
                 from fully_shard, so DDP and single-device runs train in fp32
  "ddp-amp"      the same, with torch.autocast for DDP and single-device runs;
                 TP or PP without FSDP still trains in fp32
                 (utils.maybe_enable_amp)
  "replicate"    dp_replicate alone is FSDP2's replicate (replicate_with_fsdp)
                 with a MixedPrecisionPolicy, on any mesh
  "fully-shard"  fully_shard at every degree (dp_shard 1 included): the
                 MixedPrecisionPolicy casts everywhere, no autocast, no DDP
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines.base import Engine
from planner.engines.mechanisms import (
    DTENSOR,
    GROUPED_EXPERTS,
    TORCH_CONTEXT_PARALLEL,
    TORCH_DATA_PARALLEL,
    TORCH_PIPELINING,
    Loss,
    ModelCode,
)
from planner.engines.precision import TORCHAO_FP8
from planner.engines.releases import Change, Release, build_releases
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec

DP_IMPLS = ("ddp-fp32", "ddp-amp", "replicate", "fully-shard")


@dataclass(frozen=True)
class TorchtitanEngine(Engine):
    """torchtitan at one release: `dp_impl` (module docstring) decides its data-parallel path."""

    dp_impl: str = "ddp-fp32"

    def dp_path(self, layout: Layout) -> str:
        if self.dp_impl == "fully-shard" or layout.dp_shard * layout.cp > 1:
            return "fsdp"
        if layout.dp_replicate > 1:
            return "replicate" if self.dp_impl == "replicate" else "ddp"
        return "none"

    def refusal(self, model: ModelSpec, layout: Layout, dtype: str, on_gpu: bool,
                training: TrainingSpec | None = None) -> str | None:
        common = self._common_refusal(model, layout, training)
        if common:
            return common
        who = f"engine {self.label}"
        if layout.cp > 1 and layout.zero_stage < 2:
            return (f"{who} shards parameters over dp_shard x cp whenever cp > 1 (fully_shard on its dp_shard_cp "
                    f"mesh), got ZeRO-{layout.zero_stage} with cp {layout.cp}; plan with --zero 2 or 3")
        path = self.dp_path(layout)
        if path == "ddp" and (layout.tp > 1 or layout.pp > 1):
            return (f"{who} runs dp_replicate alone as DDP, which refuses other mesh dimensions (\"DDP has not "
                    f"supported > 1D parallelism\"), got dp {layout.dp} with tp {layout.tp}, pp {layout.pp}; plan "
                    "with --zero 2 or 3 (FSDP2), or torchtitan@2026-03 (FSDP2's replicate)")
        if dtype in ("bf16", "fp16") and path in ("none", "ddp"):
            fp32 = self.dp_impl == "ddp-fp32" or layout.tp > 1 or layout.pp > 1
            if fp32:
                return (f"{who} casts to {dtype} only through FSDP2 here (no autocast for "
                        f"{'DDP or one device' if self.dp_impl == 'ddp-fp32' else 'TP or PP without FSDP'}): this "
                        "layout would train in fp32; plan with --zero 2 or 3, --precision fp32, or a newer release")
        return None


_BASE = TorchtitanEngine(
    "torchtitan", "", "", data_parallel=TORCH_DATA_PARALLEL, tensor_parallel=DTENSOR,
    loss=Loss("torch-loss-parallel"), pipeline=TORCH_PIPELINING, context_parallel=TORCH_CONTEXT_PARALLEL,
    model_code=ModelCode("torchtitan.models.llama3", eager_final_norm=True, repeats_kv=True),
    experts=GROUPED_EXPERTS, fp8=TORCHAO_FP8, recompute_kinds=("none", "op", "full"), compiles=True,
    zero_stages=(0, 2, 3),  # DDP / replicate, FSDP2 without or with resharding after forward
    cp_needs_fused=True, async_tp_option="enable_async_tensor_parallel", async_tp_needs_compile=True,
    dp_impl="ddp-fp32")

RELEASES: dict[str, Engine] = build_releases(_BASE, (
    Release("2024-04", "torchtitan 0413364 of 2024-04-24 (docs/performance.md's A100 tables)"),
    Release("2024-12", "torchtitan 9dec370 of 2024-12-26 (benchmarks/llama3_h100_202412_torchtitan.md)"),
    Release("2025-06", "torchtitan e7c0cae of 2025-06-11 (benchmarks/llama3_8b_h200_2025-06_torchtitan.md)"),
    Release("2025-10", "torchtitan v0.2.0 of 2025-10-17"),
    Release("2026-02", "torchtitan v0.2.2 of 2026-02-20"),
    Release("2026-03", "torchtitan e1847f4 of 2026-03-09 (FSDP2's replicate for dp_replicate)"),
    Release("2026-04", "torchtitan 00b7f56 of 2026-04-09 (fully_shard at every degree)"),
), (
    Change("2024-12", "training.enable_cpu_offload in the release's config_manager.py (FSDP2 CPUOffloadPolicy)",
           "parameters, gradients and the optimizer step on the host", {"offload_kinds": ("none", "optimizer+params")}),
    Change("2025-06", "bbb1b616e of 2025-04-02 (#1033, build_loss_fn)",
           "--training.compile compiles the loss with the blocks: compute-dtype logits and gradient",
           {"loss": Loss("torch-loss-parallel", fused="compile")}),
    Change("2025-10", "0b44d4c of 2025-06-16 (#1303, support AMP for DDP / single-device training; in v0.1.0)",
           "torch.autocast for DDP and single-device runs", {"dp_impl": "ddp-amp"}),
    Change("2025-10", "torch 2.9's torch.distributed.pipelining.ScheduleDualPipeV, which "
           "--parallelism.pipeline_parallel_schedule DualPipeV picks (get_schedule_class)",
           "DualPipeV: the V placement in DeepSeek's order, forward and backward passes of two micro-batches "
           "overlapped", {"pp_schedules": ("gpipe", "1f1b", "interleaved-1f1b", "zb-v", "dualpipev")}),
    Change("2026-02", "ff0829c10 of 2026-01-27 (#2259, GQA without kv repeats)",
           "SDPA takes GQA's K/V without repeating them to the query heads",
           {"model_code": ModelCode("torchtitan.models.llama3", eager_final_norm=True)}),
    Change("2026-03", "e1847f4 of 2026-03-09 (#2458, new replicate integration)",
           "dp_replicate alone by FSDP2's replicate with a MixedPrecisionPolicy, on any mesh",
           {"dp_impl": "replicate"}),
    Change("2026-04", "00b7f56 of 2026-04-09 (#2900, replace amp and replicate with fully_shard)",
           "fully_shard at every degree; no autocast", {"dp_impl": "fully-shard"}),
))
