"""Pipeline parallelism: cut the model into stages, wrap them as PipelineStages, pick the schedule.

Which layers a stage owns (`planner.layout.stage_ranges` of the plan's
`layers_per_stage`, pp * virtual_stages entries) and which stages a pipeline
rank holds (`Layout.stages_of`, i.e. `planner.layout.rank_chunks`) are the
planner's rules, imported here so the stages that run are the stages the
memory model and simulator priced; the first stage also owns the embeddings,
the last the final norm and output layer. A stage is the full
model with everything else deleted (torchtitan's way), so parameter names
stay those of the single-process model and checkpoints reshard across
layouts.

Micro-batches: the schedule cuts each data-parallel rank's local batch
(micro_batch_size * grad_accum_steps sequences) into grad_accum_steps
micro-batches; with `scale_grads=True` it divides gradients by their number,
so the update equals the mean loss over the local batch, as without PP.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.layout import Layout, stage_ranges
from topologies.errors import PlanError


def split_stage(model: nn.Module, layout: Layout, stage: int) -> nn.Module:
    """A copy of `model` holding only what `stage` owns (call on the meta device: copying is free).

    Blocks of other stages are deleted from the `layers` ModuleDict; the
    embeddings live on stage 0 and the final norm and output layer on the
    last stage, elsewhere they are set to None.
    """
    n_stages = layout.pp * layout.virtual_stages
    part = copy.deepcopy(model)
    keep = {str(i) for i in stage_ranges(layout.layers_per_stage)[stage]}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
        part.pos_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def check_pipeline(layout: Layout, tie_embeddings: bool) -> None:
    """Refuse what the executor cannot pipeline, before any rank starts."""
    if not layout.layers_per_stage:
        raise PlanError("plan.parallel.layers_per_stage is empty: re-create the plan with `meshplan plan`")


def build_schedule(stages: list, layout: Layout, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The plan's schedule over this rank's PipelineStages, grad_accum_steps micro-batches."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    kind = layout.pp_schedule
    n_micro = layout.grad_accum_steps
    if kind in ("gpipe", "1f1b"):
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        return cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True)
    cls = ScheduleInterleaved1F1B if kind == "interleaved-1f1b" else ScheduleZBVZeroBubble
    return cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True)


def make_stages(runners: list[nn.Module], ids: list[int], layout: Layout, mesh: DeviceMesh,
                device: torch.device) -> list:
    """Wrap each local stage module (already parallelized) in a PipelineStage on the pp group."""
    from torch.distributed.pipelining import PipelineStage

    n_stages = layout.pp * layout.virtual_stages
    group = mesh.get_group("pp")
    return [PipelineStage(runner, stage, n_stages, device, group=group) for runner, stage in zip(runners, ids, strict=True)]
