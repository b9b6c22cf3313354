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
micro-batches. The training loop's loss function already scales each
micro-batch's summed loss by the global batch's count of counted targets
(executor/train.py), so it asks for `scale_grads=False`; with the default
True the schedule divides gradients by the number of micro-batches instead.
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


def build_schedule(stages: list, layout: Layout, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   scale_grads: bool = True):
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
        return cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=scale_grads)
    cls = ScheduleInterleaved1F1B if kind == "interleaved-1f1b" else ScheduleZBVZeroBubble
    return cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=scale_grads)


def make_stages(runners: list[nn.Module], ids: list[int], layout: Layout, mesh: DeviceMesh,
                device: torch.device) -> list:
    """Wrap each local stage module (already parallelized) in a PipelineStage on the pp group."""
    from torch.distributed.pipelining import PipelineStage

    n_stages = layout.pp * layout.virtual_stages
    group = mesh.get_group("pp")
    return [PipelineStage(runner, stage, n_stages, device, group=group) for runner, stage in zip(runners, ids, strict=True)]


class TiedGradSync:
    """Tied embeddings across stages: the first stage's embedding and the last stage's output weight.

    Both start from the embedding's initial value (executor.model.full_init_value)
    and get the same update if their gradients are summed after the step's
    backward: an all-reduce between the pipeline rank holding stage 0 and the
    one holding the last stage, for every (dp, cp, tp) position (each pair is
    a group); when one rank holds both (zb-v's V) the sum is local. The
    gradients' local shards line up because both stages are sharded alike
    over the same dp axes. Clipping must count the sum once: `norm_skip`
    names the last stage's copy.
    """

    def __init__(self, parts: list[nn.Module], stages: list[int], layout: Layout, mesh: DeviceMesh) -> None:
        import torch.distributed as dist

        last = layout.pp * layout.virtual_stages - 1
        self.first = [p.tok_embeddings.weight for p, s in zip(parts, stages, strict=True) if s == 0]
        self.last = [p.output.weight for p, s in zip(parts, stages, strict=True) if s == last]
        self.norm_skip = {id(w) for w in self.last}
        pp_of = {s: r for r in range(layout.pp) for s in layout.stages_of(r)}
        self.group = None
        if pp_of[0] != pp_of[last]:  # one group per pair of ranks, created on every rank in one order
            grid = mesh.mesh.reshape(layout.pp, -1)
            me = dist.get_rank()
            for col in range(grid.shape[1]):
                ranks = sorted({int(grid[pp_of[0], col]), int(grid[pp_of[last], col])})
                group = dist.new_group(ranks)
                if me in ranks:
                    self.group = group

    @torch.no_grad()
    def __call__(self) -> None:
        import torch.distributed as dist

        grads = [_local(w.grad) for w in self.first + self.last if w.grad is not None]
        if self.group is None:  # both on this rank
            if len(grads) == 2:
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
            return
        for g in grads:
            dist.all_reduce(g, group=self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
