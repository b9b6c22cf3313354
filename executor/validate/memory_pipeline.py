"""One pipeline rank's step for `validate-memory`: the 1F1B order run on the rank's own stage module.

torch.distributed.pipelining cannot run under a fake process group: before
its first step the stages exchange shapes and a warm-up vote whose values a
fake collective never delivers. So the harness runs, on the stage module the
executor built and parallelized (executor.parallel.pipeline.split_stage,
parallelize), what Schedule1F1B runs on that rank, in its order: pp - r
forwards before the first backward (the warm-up), then one forward and one
backward in turn, then the remaining backwards (the cool-down); each
micro-batch's stage input is a fresh buffer (the activation received from
the previous stage, kept until its backward), each non-last stage's backward
starts from a fresh gradient buffer (the one received from the next stage),
the last stage's from its loss, scaled by 1 / micro-batches as
`scale_grads=True` does. Gradients accumulate over the micro-batches, then
clipping and the optimizer step run as in any step.

Only 1F1B over one stage per rank (no interleaving, no zb-v) and gradient
sync "none" or "replicate"-free layouts (dp 1) are emulated; others are
refused with the reason. The order per rank is the one tests/unit/test_pipeline.py
pins against torch's schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from planner.plan import Plan
from topologies.errors import PlanError


def check_emulated(plan: Plan) -> None:
    """Refuse the pipeline layouts this emulation does not reproduce."""
    layout = plan.layout
    if layout.pp_schedule != "1f1b" or layout.virtual_stages != 1 or layout.dp * layout.cp > 1:
        raise PlanError(
            f"validate-memory runs pipeline plans as 1F1B with one stage per rank and no data parallelism "
            f"(got schedule {layout.pp_schedule}, virtual_stages {layout.virtual_stages}, dp x cp "
            f"{layout.dp * layout.cp}): torch.distributed.pipelining exchanges real shapes and votes between "
            "stages, which a fake process group cannot deliver; check the 1F1B dp 1 layout, or measure with "
            "`meshplan execute`"
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


def pipeline_micro_steps(plan: Plan, pm, tokens: torch.Tensor, dtype: torch.dtype,  # noqa: ANN001
                         before_forward: Callable[[int], None]) -> None:
    """Forwards and backwards of this rank's stage in 1F1B order (module docstring); before_forward(i)
    runs before micro-batch i's forward (the tracker's per-module statistics are reset there)."""
    from executor.train import _autocast, lm_loss

    layout = plan.layout
    stage = pm.stages[0]
    last = stage == layout.pp - 1
    runner = pm.runners[0]
    n = layout.grad_accum_steps
    inputs = tokens.chunk(n)
    shape = (layout.micro_batch_size, plan.training.seq_len, plan.model.hidden)
    kept: dict[int, torch.Tensor] = {}
    for op, i in order_1f1b(stage, layout.pp, n):
        if op == "F":
            before_forward(i)
            x = inputs[i] if stage == 0 else torch.empty(shape, dtype=dtype, requires_grad=True)
            with _autocast(pm, torch.device("cpu")):
                out = runner(x)
                kept[i] = lm_loss(out, inputs[i]) / n if last else out
            continue
        out = kept.pop(i)
        if last:
            out.backward()
        else:
            out.backward(torch.empty_like(out))
