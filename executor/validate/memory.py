"""`meshplan validate-memory`: the memory model against PyTorch's own tracker, one rank of the full world.

For a rank r of the plan's world (rank 0 and the first rank of the pipeline
stage the memory model calls worst), in ONE process and without a GPU:

  1. a fake process group of the plan's full world size
     (`torch.testing._internal.distributed.fake_pg.FakeStore`, backend "fake"):
     collectives return at once and move nothing, but every shape, shard and
     buffer is what rank r would hold;
  2. under FakeTensorMode, the executor's own `build_model` + `parallelize`
     (the plan's TP, CP, EP, FSDP/HSDP, DDP + ZeroRedundancyOptimizer, float8
     when torchao is installed, the rank's pipeline stage), on the CPU in the
     plan's dtype (a bf16 GPU plan keeps bf16: tensors are fake, so no CPU
     kernel ever runs); MoE routing is balanced (fake tensors have no values)
     and a pipeline rank's stages run in torch's schedule order
     (executor.validate.memory_pipeline: 1F1B, interleaved 1F1B);
  3. the optimizer's state is created first (a step on zero gradients), so the
     tracked step is a steady-state one: then forward, backward and optimizer
     step of min(grad_accum_steps, 2) micro-batches (the second one carries the
     first one's accumulated gradients, as every later one does) run under
     `FSDPMemTracker` (FSDP2 plans) or `MemTracker` (DDP plans);
  4. the tracker's peak snapshot, mapped to the plan.json categories, is put
     next to `planner.memory.estimate.estimate_memory` for the same rank's stage.

Compared bytes are tensor bytes: the memory model's `other` (CUDA context,
NCCL buffers, fragmentation) has no tensor and is left out of both sides.
Tracker categories -> plan.json categories:
  params        Parameter / Sharded Param, Buffer (rope tables); under ZeRO-2 the
                Unsharded Param too (the memory model's bf16 compute copy, kept
                from forward to backward)
  grads         Gradient / Sharded Grad
  optimizer     Optstate
  activations   Activation, Temp (backward temporaries), Inputs
  comm_buffers  All Gather, Reduce Scatter, Unsharded Grad, Unsharded Param under
                ZeRO-3, and DDP's bucket buffers (Other: allocated by the C++
                reducer outside any dispatch mode, registered as same-size
                stand-ins so the tracker counts them)
Under parameter offload (FSDP2's CPUOffloadPolicy) the sharded parameters, their gradients and the
optimizer state are host memory: the peak compared is the GPU's (the tracked total less those, at the
moment it is largest), and the host's share is reported beside it.
Attribution can differ while totals agree (autocast's bf16 weight copies are
"Activation" to the tracker and "params" to the model): the 10% criterion is
on the peak.
"""

from __future__ import annotations

from typing import Any

from planner.plan import MEMORY_CATEGORIES, Plan, load_plan
from topologies.errors import PlanError
from topologies.hardware import GIB

TOLERANCE = 0.10  # |predicted - tracked| / tracked the memory model must meet
_TRACKER_CATEGORY = {
    "Parameter": "params", "Sharded Param": "params", "Buffer": "params",
    "Gradient": "grads", "Sharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Temp": "activations", "Inputs": "activations",
    "All Gather": "comm_buffers", "Reduce Scatter": "comm_buffers", "Unsharded Grad": "comm_buffers",
    "Other": "comm_buffers",
}
TENSOR_CATEGORIES = tuple(c for c in MEMORY_CATEGORIES if c != "other")


def tracked_categories(raw: dict[str, int], zero_stage: int) -> dict[str, int]:
    """The tracker's peak snapshot (category name -> bytes) in plan.json categories."""
    out = dict.fromkeys(TENSOR_CATEGORIES, 0)
    for name, value in raw.items():
        if name in ("Total", "Host"):
            continue
        if name == "Unsharded Param":
            out["params" if zero_stage == 2 else "comm_buffers"] += value
        else:
            out[_TRACKER_CATEGORY[name]] += value
    return out


def predicted_categories(plan: Plan, rank: int) -> tuple[int, dict[str, int]]:
    """(pipeline stage of rank, the memory model's tensor bytes by category for that stage)."""
    from planner.memory.estimate import estimate_memory

    est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
    stage = rank // (plan.world_size // plan.layout.pp)
    return stage, {c: int(est.per_stage[stage][c]) for c in TENSOR_CATEGORIES}


def ranks_to_check(plan: Plan) -> list[int]:
    """Rank 0 and the first rank of the memory model's worst pipeline stage."""
    from planner.memory.estimate import estimate_memory

    est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
    return sorted({0, est.worst_rank})


def compare(plan: Plan, rank: int, raw: dict[str, int]) -> dict[str, Any]:
    """One rank's report: predicted and tracked peaks, their error, and the categories side by side."""
    stage, predicted = predicted_categories(plan, rank)
    tracked = tracked_categories(raw, plan.layout.zero_stage)
    pred_peak, tracked_peak = sum(predicted.values()), int(raw["Total"])
    return {
        "rank": rank,
        "stage": stage,
        "predicted_peak_bytes": pred_peak,
        "tracked_peak_bytes": tracked_peak,
        "error": (pred_peak - tracked_peak) / tracked_peak if tracked_peak else None,
        "by_category": {c: {"predicted": predicted[c], "tracked": tracked[c], "difference": predicted[c] - tracked[c]}
                        for c in TENSOR_CATEGORIES},
        "tracker_categories": {k: v for k, v in raw.items() if k not in ("Total", "Host")},
        **(_host(plan, stage, raw["Host"]) if "Host" in raw else {}),
    }


def _host(plan: Plan, stage: int, tracked: int) -> dict[str, Any]:
    """Under parameter offload: the host's share at the GPU's peak (sharded parameters, gradients and optimizer
    state, executor.validate.memory_step.HOST_CATEGORIES) next to the memory model's host bytes."""
    from planner.memory.params import pipeline_params
    from planner.memory.states import stage_states

    sp = pipeline_params(plan.model, plan.layout, plan.engine)[stage]
    predicted = stage_states(plan.model, plan.training, plan.layout, sp, plan.engine).host
    return {"host": {"predicted_bytes": predicted, "tracked_bytes": tracked,
                     "note": "tracked at the GPU's peak: the gradients reduced so far"}}


def validate_plan(plan: Plan, ranks: list[int] | None = None, progress=None) -> dict[str, Any]:
    """Track one steady-state step for each rank; the worst tracked rank gives the top-level figures.

    progress: a `topologies.terminal.Progress`, advanced per rank and told each rank's phase.
    """
    from executor.validate.memory_step import tracked_peak
    from planner.engines import get_engine

    if plan.training.lora and get_engine("meshplan").dp_path(plan.layout) != "fsdp":
        # torch.distributed._tools.MemTracker registers a gradient hook on every parameter of a module it enters
        # (_track_module_params_and_buffers), which torch refuses on a frozen one; FSDPMemTracker does not
        raise PlanError("validate-memory of a LoRA plan runs FSDP2's tracker only (ZeRO-2/3): torch's MemTracker, "
                        "used for DDP and single-rank plans, registers a gradient hook on every parameter and "
                        "fails on the frozen base; validate a ZeRO-2/3 layout of the same plan")
    ranks = ranks or ranks_to_check(plan)
    bad = [r for r in ranks if not 0 <= r < plan.world_size]
    if bad:
        raise PlanError(f"--rank {bad} is outside the plan's world of {plan.world_size} ranks (0..{plan.world_size - 1})")
    if progress is not None:
        progress.update(total=len(ranks))
    reports = []
    for r in ranks:
        def phase(text: str, rank: int = r) -> None:
            if progress is not None:
                progress.describe(f"rank {rank}: {text}")

        reports.append(compare(plan, r, tracked_peak(plan, r, on_phase=phase)))
        if progress is not None:
            progress.advance()
    worst = max(reports, key=lambda rep: rep["tracked_peak_bytes"])
    return {
        "model": plan.model.name,
        "world_size": plan.world_size,
        "layout": plan.layout.to_json(),
        "dtype": plan.training.dtype,
        "tolerance": TOLERANCE,
        "within_tolerance": all(r["error"] is not None and abs(r["error"]) <= TOLERANCE for r in reports),
        **{k: worst[k] for k in ("rank", "predicted_peak_bytes", "tracked_peak_bytes", "error", "by_category")},
        "ranks": reports,
    }


def validate_plan_file(path: str, ranks: tuple[int, ...] | list[int] | None = None, progress=None) -> dict[str, Any]:
    return validate_plan(load_plan(path), list(ranks) if ranks else None, progress)


def render_validation(doc: dict[str, Any]) -> None:
    """Human view: one table per checked rank, predicted | tracked | difference by category."""
    from rich.table import Table

    from topologies.terminal import console

    out = console()
    for rep in doc["ranks"]:
        err = rep["error"]
        table = Table(title=f"{doc['model']}, rank {rep['rank']} (stage {rep['stage']}) of {doc['world_size']}: "
                            f"predicted {rep['predicted_peak_bytes'] / GIB:.2f} GiB, tracked "
                            f"{rep['tracked_peak_bytes'] / GIB:.2f} GiB ({100 * err:+.1f}%)")
        for col in ("category", "predicted", "tracked", "difference"):
            table.add_column(col, justify="left" if col == "category" else "right")
        for cat, row in rep["by_category"].items():
            table.add_row(cat, *(f"{row[k] / 2**20:,.1f} MiB" for k in ("predicted", "tracked", "difference")))
        out.print(table)
    tol = f"{100 * doc['tolerance']:.0f}%"
    outside = [r["rank"] for r in doc["ranks"] if r["error"] is None or abs(r["error"]) > doc["tolerance"]]
    verdict = (f"predicted peak within {tol} of PyTorch's tracker on every checked rank" if not outside else
               f"predicted peak OUTSIDE {tol} of PyTorch's tracker on rank(s) {outside}: the memory model needs work")
    out.print(f"{verdict} (tensor bytes; the model's fixed `other` overhead is left out of both)")
