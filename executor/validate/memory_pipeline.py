"""One pipeline rank's step for `validate-memory`: torch's schedule order run on the rank's own stage modules.

torch.distributed.pipelining cannot run under a fake process group: before
its first step the stages exchange shapes and a warm-up vote whose values a
fake collective never delivers. So the harness runs, on the stage modules the
executor built and parallelized (executor.parallel.pipeline.split_stage,
parallelize), the forwards and backwards torch's schedule runs on that rank,
in its order (`rank_order`):

  1f1b              Schedule1F1B's step loop: pp - r forwards (the warm-up),
                    then one backward and one forward in turn, then the
                    remaining backwards (`order_1f1b`; its pipeline_order is
                    only a description, tests/unit/test_schedule_torch.py);
  interleaved-1f1b  ScheduleInterleaved1F1B's own pipeline_order for this
                    rank, read from the schedule the executor builds
                    (executor.parallel.pipeline.build_schedule) over
                    stand-in stages on the plan's pp group: the rank's
                    chunks r, r + pp, ... in torch's depth-first order.

What each action allocates follows torch 2.13's PipelineStage (stage.py):
a non-first stage receives its input into one buffer per micro-batch,
allocated at the first step and reused by every later one
(`_setup_forward_recv_info`), a non-last stage its output gradient likewise
(`_setup_backward_recv_info`); the boundary tensor is the residual stream
(fp32 under autocast, else the compute dtype). The input gradient a backward
leaves on the received buffer is taken off it at once (`stage_backward` sets
`.grad = None`) and lives until it is sent. The last stage's loss backward
starts from its loss; its outputs (the logits) are not kept for the step's
return value, because the executor steps with `return_outputs=False`
(executor.train.PipelineStep). Data-parallel stages (FSDP2 or replicate
units) run as `backward_maybe_with_nosync` runs them: no gradient sync, no
reshard after backward, unsharded gradients accumulated over the
micro-batches; the interleaved runtime gathers each stage whole before its
first compute (UNSHARD) and releases it after its last (RESHARD). After a
stage's last backward torch's own `perform_reduce_grad` reduces its
gradients and divides them by the micro-batch count (`scale_grads=True`);
then clipping and the optimizer step run as in any step.

Emulated: 1F1B with one stage per rank and interleaved 1F1B, without
context or tensor parallelism, interleaved not under FSDP (the tracker
follows one FSDP root); others are refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from planner.layout import Layout
from planner.plan import Plan
from topologies.errors import PlanError


def check_emulated(plan: Plan) -> None:
    """Refuse the pipeline layouts this emulation does not reproduce."""
    from planner.engines import get_engine

    layout = plan.layout
    schedule_ok = (layout.pp_schedule == "1f1b" and layout.virtual_stages == 1) or \
        layout.pp_schedule == "interleaved-1f1b"
    if not schedule_ok or layout.cp > 1:
        raise PlanError(
            f"validate-memory runs pipeline plans as 1F1B (one stage per rank) or interleaved 1F1B without context "
            f"parallelism (got schedule {layout.pp_schedule}, virtual_stages {layout.virtual_stages}, cp "
            f"{layout.cp}): torch.distributed.pipelining exchanges real shapes and votes between stages, which a "
            "fake process group cannot deliver, so the harness replays those two schedules; check such a layout, "
            "or measure with `meshplan execute`"
        )
    if layout.tp > 1:
        raise PlanError(
            f"validate-memory does not replay pipeline stages under tensor parallelism (tp {layout.tp}): the "
            "stage boundary and the loss-parallel logits are DTensors that torch's PipelineStage rebuilds from its "
            "local receive buffers, which the harness does not; check the layout with tp 1, or measure with "
            "`meshplan execute`"
        )
    if layout.virtual_stages > 1 and get_engine("meshplan").dp_path(layout) == "fsdp":
        raise PlanError(
            f"validate-memory cannot track interleaved 1F1B under FSDP (zero_stage {layout.zero_stage}, dp "
            f"{layout.dp}): PyTorch's FSDPMemTracker follows one FSDP root and a rank holds {layout.virtual_stages} "
            "stage roots; check the layout with ZeRO 0/1 replicas or 1F1B, or measure with `meshplan execute`"
        )


def order_1f1b(pp_rank: int, pp: int, n_micro: int) -> list[tuple[str, int]]:
    """("F" | "B", micro-batch) in Schedule1F1B's order for one rank."""
    warmup = min(pp - pp_rank, n_micro)
    ops = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < n_micro:
        ops.append(("B", backward))
        backward += 1
        if forward < n_micro:
            ops.append(("F", forward))
            forward += 1
    return ops


def rank_order(layout: Layout, pp_rank: int, pp_group) -> list[tuple[str, int, int | None]]:  # noqa: ANN001
    """(action, stage, micro-batch) in the order torch's schedule runs them on pipeline rank `pp_rank`.

    Actions: "F", "B", and for the stage as a whole (micro-batch None) "UNSHARD", "RESHARD" (FSDP) and
    "REDUCE" (the gradients' reduction and 1 / micro-batches scaling after the stage's last backward).
    1F1B: Schedule1F1B's loop, then its reduction. Interleaved 1F1B: the executor's own schedule
    (build_schedule) over stand-in stages (parameterless modules on the plan's pp group, so nothing is
    allocated) lowers its pipeline_order to the action list its runtime executes
    (pipeline_order_with_comms, sends and receives left out); the list depends only on pp, the rank's
    stages and the micro-batch count.
    """
    n = layout.grad_accum_steps
    if layout.pp_schedule == "1f1b":
        return [(op, pp_rank, i) for op, i in order_1f1b(pp_rank, layout.pp, n)] + [("REDUCE", pp_rank, None)]
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    from executor.parallel.pipeline import build_schedule

    kinds = {Kind.FORWARD: "F", Kind.FULL_BACKWARD: "B", Kind.UNSHARD: "UNSHARD", Kind.RESHARD: "RESHARD",
             Kind.REDUCE_GRAD: "REDUCE"}
    n_stages = layout.pp * layout.virtual_stages
    with unset_fake_temporarily():
        stages = [PipelineStage(torch.nn.Identity(), s, n_stages, torch.device("cpu"), group=pp_group)
                  for s in layout.stages_of(pp_rank)]
        schedule = build_schedule(stages, layout, lambda output, target: output)
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in schedule.pipeline_order_with_comms[pp_rank] if a is not None and a.computation_type in kinds]


class _StageReduction:
    """torch's own PipelineStage.perform_reduce_grad (and the scale_grads it calls) on a stage module.

    The harness has no PipelineStage (module docstring); these two methods read only `submod`: FSDP2 /
    replicate units reduce-scatter or all-reduce what they accumulated over the micro-batches, then the
    gradients are divided by the micro-batch count in place."""

    def __init__(self, submod: torch.nn.Module) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.submod = submod
        self.perform_reduce_grad = partial(_PipelineStageBase.perform_reduce_grad, self)
        self.scale_grads = partial(_PipelineStageBase.scale_grads, self)


def _fsdp_units(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def pipeline_micro_steps(plan: Plan, pm, mesh, tokens: torch.Tensor, dtype: torch.dtype,  # noqa: ANN001
                         before_forward: Callable[[torch.nn.Module], None]) -> None:
    """Forwards and backwards of this rank's stages in torch's order (module docstring); before_forward(m)
    runs before each forward of stage module m (the tracker forgets m's statistics of the previous
    micro-batch there: it refuses a root module's second forward, and another stage's backward may still
    need that stage's statistics)."""
    from executor.train import _autocast, lm_loss

    layout = plan.layout
    n = layout.grad_accum_steps
    last = layout.pp * layout.virtual_stages - 1
    runners = dict(zip(pm.stages, pm.runners, strict=True))
    inputs = tokens.chunk(n)
    shape = (layout.micro_batch_size, plan.training.seq_len, plan.model.hidden)
    boundary = torch.float32 if pm.autocast_dtype is not None else dtype  # the residual stream's dtype
    # PipelineStage's receive buffers: one per micro-batch, kept from the first step on
    received = {s: [torch.empty(shape, dtype=boundary, requires_grad=True) for _ in range(n)]
                for s in pm.stages if s != 0}
    output_grads = {s: [torch.empty(shape, dtype=boundary) for _ in range(n)] for s in pm.stages if s != last}
    order = rank_order(layout, mesh.get_local_rank("pp"), mesh.get_group("pp"))
    kept: dict[tuple[int, int], torch.Tensor] = {}
    for op, stage, i in order:
        runner = runners[stage]
        units = _fsdp_units(runner)
        if op == "UNSHARD":  # the runtime gathers every FSDP unit of the stage ahead of its compute
            for unit in units:
                unit.unshard()
        elif op == "RESHARD":
            for unit in units:
                unit.reshard()
        elif op == "REDUCE":
            _StageReduction(runner).perform_reduce_grad(n)
        elif op == "F":
            before_forward(runner)
            x = inputs[i] if stage == 0 else received[stage][i]
            with _autocast(pm, torch.device("cpu")):
                out = runner(x)
                kept[stage, i] = lm_loss(out, inputs[i]) if stage == last else out
            del out
        else:
            if units:  # PipelineStage.backward_maybe_with_nosync: accumulate, keep gathered, reduce at the end
                runner.set_is_last_backward(False)
                runner.set_reshard_after_backward(False)
                runner.set_requires_gradient_sync(False)
            out = kept.pop((stage, i))
            if stage == last:
                out.backward()
            else:
                out.backward(output_grads[stage][i])
            del out
            if stage != 0:  # stage_backward takes the input gradient off the buffer; it is sent right away
                received[stage][i].grad = None
