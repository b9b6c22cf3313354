"""meshplan: this repository's executor (executor/), the one engine `meshplan execute` runs.

What executor/parallel/parallelize.py, executor/model.py and
executor/components/optim.py do: SDPA (fused) attention; DDP or FSDP2
overlap the gradient reduction with the backward; DTensor TP runs its
collectives in line with loss_parallel under TP; a tied embedding is not
TP-sharded; DDP keeps its default gradient_as_bucket_view=False;
fully_shard(part) makes the embedding, final norm and output the root unit;
gradients are set to None after every step (phases measured with PyTorch's
tracker: validate-memory); the model keeps rope_cos/rope_sin buffers of
max_seq_len rows; ZeRO-1 is torch's ZeroRedundancyOptimizer; sequence parallel
is DTensor's PrepareModuleInput (saves the gathered inputs); parameters are
fp32 under autocast or FSDP2's MixedPrecisionPolicy; pipelines are
torch.distributed.pipelining's schedules; float8 is torchao's.

The executor imports `dp_path`, `autocast` (Engine) and `refusal` from here,
so a plan for `--engine meshplan` is one `meshplan execute` runs. One release:
this repository's (pyproject version 0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines.base import Engine, offload_refusal
from planner.engines.mechanisms import (
    DTENSOR,
    EXECUTOR_EXPERTS,
    EXECUTOR_KV_ALL_GATHER,
    MESHPLAN_MODEL,
    TORCH_PIPELINING,
    TORCH_ZERO_REDUNDANCY,
    Loss,
)
from planner.engines.precision import TORCHAO_FP8
from planner.engines.refusals import fp8_refusal, unbuilt_features
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec


def executor_dp_path(layout: Layout) -> str:
    """How meshplan's executor syncs gradients: none, ddp, replicate (DTensor params, FSDP2 replicate) or fsdp.

    executor.parallel.parallelize applies exactly this path; planner.memory prices its buffers.
    """
    if layout.dp * layout.cp == 1:  # cp ranks see other tokens of the same sequences: their gradients sync too
        return "none"
    if layout.zero_stage >= 2:
        return "fsdp"
    return "replicate" if layout.tp > 1 or layout.pp > 1 else "ddp"


@dataclass(frozen=True)
class MeshplanEngine(Engine):
    """meshplan's executor: its data-parallel path and its refusals (what it does not build)."""

    def dp_path(self, layout: Layout) -> str:
        return executor_dp_path(layout)

    def refusal(self, model: ModelSpec, layout: Layout, dtype: str, on_gpu: bool,
                training: TrainingSpec | None = None) -> str | None:
        if layout.pp > 1 and layout.pp_schedule == "dualpipev":
            return ("meshplan's executor does not run DualPipeV (pp_schedule 'dualpipev'): its overlapped "
                    "forward-backward passes need a model-specific overlap of one micro-batch's expert all-to-alls "
                    "with another's compute, which executor.parallel does not build; plan with --pp-schedule zb-v, "
                    "or with --engine torchtitan@2025-10 or newer and export the layout")
        return self._common_refusal(model, layout, training) or \
            executor_refusal(model, layout, dtype, on_gpu, training)

    def model_refusal(self, model: ModelSpec) -> str | None:
        return _unbuilt_refusal(model)


def _unbuilt_refusal(model: ModelSpec) -> str | None:
    unbuilt = unbuilt_features(model)
    if not unbuilt:
        return None
    return (f"model {model.name!r} uses {', '.join(unbuilt)}, which meshplan's executor does not build; plan "
            "it with --engine megatron or --engine torchtitan or --engine deepspeed and export the layout to "
            "that stack")


# FSDP2's CPUOffloadPolicy (executor.parallel.parallelize.offload_policy): parameters, gradients and the
# optimizer step on the host together; no optimizer-only offload
EXECUTOR_OFFLOAD_KINDS = ("none", "optimizer+params")


def executor_refusal(model: ModelSpec, layout: Layout, dtype: str = "bf16", on_gpu: bool = True,
                     training: TrainingSpec | None = None) -> str | None:
    """Why meshplan's executor cannot run this layout (one sentence with the values), or None."""
    if training is not None and training.fp8:
        reason = fp8_refusal(model, layout, training, on_gpu)
        if reason:
            return reason
    unbuilt = _unbuilt_refusal(model)
    if unbuilt:
        return unbuilt
    offload = offload_refusal(f"engine {MESHPLAN.label}", EXECUTOR_OFFLOAD_KINDS, layout)
    if offload:
        return offload
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
    return None


MESHPLAN = MeshplanEngine(
    "meshplan", "0.1", "this repository's executor (PyTorch FSDP2/DDP, DTensor TP, torch.distributed.pipelining, "
    "torchao float8)",
    data_parallel=TORCH_ZERO_REDUNDANCY, tensor_parallel=DTENSOR, loss=Loss("dtensor"), pipeline=TORCH_PIPELINING,
    context_parallel=EXECUTOR_KV_ALL_GATHER, model_code=MESHPLAN_MODEL, experts=EXECUTOR_EXPERTS, fp8=TORCHAO_FP8,
    recompute_kinds=("none", "selective", "op", "full"), compiles=True,
    offload_kinds=EXECUTOR_OFFLOAD_KINDS, lora="meshplan")
RELEASES: dict[str, Engine] = {MESHPLAN.release: MESHPLAN}
