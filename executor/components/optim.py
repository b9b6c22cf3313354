"""Optimizer, learning-rate schedule and gradient clipping for any layout.

AdamW with betas (0.9, 0.95), eps 1e-8 and weight decay 0.1 on matrices only
(norm weights, biases and nothing else 1-D are decayed; GPT-3 / Llama
practice). ZeRO-1 with TP or PP (DTensor parameters) is executor/components/zero1.py;
otherwise ZeRO-1 wraps it in ZeroRedundancyOptimizer over the dp_shard group:
each rank keeps the AdamW moments of its partition of the parameters and
broadcasts its updated parameters; with ZeRO-2/3 FSDP2 already shards the
moments (the parameters are DTensor shards), so plain AdamW is ZeRO.

Schedule (LambdaLR factor of the peak lr, k = optimizer steps done):
  warm-up   k < W:  (k + 1) / W
  cosine    k >= W: r + (1 - r) * (1 + cos(pi * t)) / 2,  t = (k - W) / max(1, T - W - 1)
with W = max(1, T // 10) warm-up steps, T the run's total steps and r = 0.1
(decay to 10% of the peak, Chinchilla / Llama 2).

AdamW runs fused (one kernel per device and dtype, torchtitan's default;
plain and DTensor parameters in groups of their own, `_fusable`): its `found_inf` tensor lets a step be
skipped on the device (`skip_update_where`), the way GradScaler skips fp16
overflows, so deciding to skip never reads a value back to the host.

Clipping to a global L2 norm of 1.0 over all parameters of all ranks, in one
all-reduce: each rank adds the squared norm of its local gradient shards,
weighted by 1 / (number of ranks holding an identical copy), and the world
sums. A parameter lives on the world / pp ranks of its pipeline stage; of
those, a DTensor's shards are distinct along its Shard mesh dims and copies
along the rest; a plain tensor is the same on all of them. The local norms
are multi-tensor kernels (torch._foreach_norm in fp32 over the local shards,
one per copy count, as torch.nn.utils.get_total_norm runs it) and the scaling is torch.nn.utils.clip_grads_with_norm_
per mesh, as torchtitan's clip_grad_norm_ does; the norm stays on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from planner.plan import Plan

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0
MIN_LR_RATIO = 0.1


def default_lr(hidden: int) -> float:
    """Peak learning rate when --lr is not given: min(3e-3, 0.02 / sqrt(hidden)).

    Wider models need smaller steps (muP-style 1/sqrt(width)); the rule gives
    3.1e-4 at h = 4096 (Llama 2 7B trained at 3e-4), 2.2e-4 at h = 8192
    (Llama 2 70B: 1.5e-4) and 2.5e-3 for the debug models (h = 64); the cap
    keeps narrower toy models stable.
    """
    return min(3e-3, 0.02 / math.sqrt(hidden))


def unique_params(parts: list[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of all local parts, tied ones once."""
    seen: set[int] = set()
    out = []
    for part in parts:
        for p in part.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def build_optimizers(parts: list[nn.Module], plan: Plan, mesh, lr: float) -> list[torch.optim.Optimizer]:
    """One AdamW per local model part (ZeroRedundancyOptimizer for ZeRO-1), as checkpoints expect."""
    return [_build_optimizer(unique_params([part]), plan, mesh, lr) for part in parts]


def _fusable(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` cut into lists fused AdamW can take in one call: plain tensors apart from DTensors, DTensors
    by mesh (its multi-tensor kernels refuse a mix: under TP, a MoE layer's experts are plain tensors beside
    DTensor blocks). One list, in order, when nothing is mixed; none when `params` is empty."""
    from torch.distributed.tensor import DTensor

    lists: dict[object, list[nn.Parameter]] = {}
    for p in params:
        lists.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(lists.values())


def _build_optimizer(params: list[nn.Parameter], plan: Plan, mesh, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": same, "weight_decay": wd} for ps, wd in ((decay, WEIGHT_DECAY), (no_decay, 0.0))
              for same in _fusable(ps)]
    kwargs = dict(lr=lr, betas=BETAS, eps=EPS, fused=True)
    layout = plan.layout
    if layout.zero_stage == 1 and layout.dp > 1 and (layout.tp > 1 or layout.pp > 1):
        from executor.components.zero1 import Zero1Optimizer
        from executor.parallel.mesh import grad_flat

        return Zero1Optimizer(groups, torch.optim.AdamW, grad_flat(mesh).get_group(), **kwargs)
    if layout.zero_stage == 1 and layout.dp_shard > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        shard = "dp_shard_cp" if layout.cp > 1 else "dp_shard"  # cp ranks hold the same weights
        # parameters_as_bucket_view: each rank broadcasts its updated parameters as one bucket, not per tensor
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                                       process_group=mesh[shard].get_group(), **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def _mesh_key(t: torch.Tensor):
    """Multi-tensor kernels take one kind of tensor: all plain, or all DTensors on one mesh."""
    from torch.distributed.tensor import DTensor

    return t.device_mesh if isinstance(t, DTensor) else None


@dataclass(frozen=True)
class WarmupCosine:
    """LambdaLR factor (see module docstring). A dataclass so the scheduler's state_dict keeps it.

    The cosine runs from factor `decay_factor` at step `decay_from` (default: 1.0 at the end of the
    warm-up) down to min_ratio at the last step; `rescheduled` moves that start to a resumed step.
    """

    total_steps: int
    warmup_steps: int
    min_ratio: float = MIN_LR_RATIO
    decay_from: int | None = None  # None: warmup_steps
    decay_factor: float = 1.0

    @classmethod
    def for_run(cls, total_steps: int) -> WarmupCosine:
        return cls(total_steps=total_steps, warmup_steps=max(1, total_steps // 10))

    def __call__(self, k: int) -> float:
        if k < self.warmup_steps:
            return (k + 1) / self.warmup_steps
        start = self.warmup_steps if self.decay_from is None else self.decay_from
        t = min(1.0, max(0, k - start) / max(1, self.total_steps - start - 1))
        return self.min_ratio + (self.decay_factor - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    def rescheduled(self, step: int, total_steps: int) -> WarmupCosine:
        """The schedule of a run resumed at `step` with `total_steps` (--allow-plan-change): from `step` on (the
        only steps it is asked for), past the warm-up, a cosine from the factor reached at `step` down to
        min_ratio at the new last step; within the warm-up, the same warm-up and then the whole cosine."""
        if step < self.warmup_steps:  # still warming up: the same warm-up, then the whole cosine to the new end
            return WarmupCosine(total_steps, self.warmup_steps, self.min_ratio)
        return WarmupCosine(total_steps, self.warmup_steps, self.min_ratio, decay_from=step, decay_factor=self(step))


def reschedule(schedulers: list[torch.optim.lr_scheduler.LambdaLR], step: int, total_steps: int) -> bool:
    """Rebuild resumed LambdaLR schedules for `total_steps` from `step` (see WarmupCosine.rescheduled); True when
    they changed. The learning rate at `step` is unchanged, so the run continues without a jump."""
    changed = False
    for scheduler in schedulers:
        lambdas = scheduler.lr_lambdas
        for i, fn in enumerate(lambdas):
            if isinstance(fn, WarmupCosine) and fn.total_steps != total_steps:
                lambdas[i] = fn.rescheduled(step, total_steps)
                changed = True
    if changed and (not dist.is_initialized() or dist.get_rank() == 0):
        from topologies.terminal import log

        log(f"optim: LR schedule rebuilt for --steps {total_steps} from step {step} (--allow-plan-change)")
    return changed


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine.for_run(total_steps))


def _local_share(grad: torch.Tensor, world: int, pp: int) -> tuple[torch.Tensor, int]:
    """(this rank's piece of a gradient, how many ranks hold that same piece); see the module docstring.

    Judged by the gradient's own placements, which may differ from its
    parameter's (a row-split embedding can get a replicated gradient).
    Partial placements are summed first: a sum of squares is not linear.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    holders = world // pp
    if not isinstance(grad, DTensor):
        return grad, holders
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    distinct = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
        if isinstance(placement, (Shard, _StridedShard)):
            distinct *= size
    return grad.to_local(), holders // distinct


@torch.no_grad()
def local_grad_norm_sq(params: list[nn.Parameter], pp: int, device: torch.device,
                       expert_holders: dict[int, int] | None = None) -> torch.Tensor:
    """This rank's share of the global squared gradient norm (fp64, 0-dim, on `device`): summed over the world
    it is the squared norm of all gradients, each distinct piece once (module docstring).

    `params` are those the norm counts (a tied weight's second copy on another pipeline stage left out);
    `expert_holders`: id(expert weight) -> ranks holding that same copy (expert parallelism). Offloaded
    gradients are reduced where they live, then moved.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_copies: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        local, copies = _local_share(p.grad, world, pp)
        copies = (expert_holders or {}).get(id(p), copies)  # expert parallel: distinct across the ep group
        by_copies.setdefault((copies, local.device, local.dtype), []).append(local)
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for (copies, _, _), tensors in by_copies.items():
        # one multi-tensor norm kernel per group, in fp32 whatever the gradients' dtype (no copy of them), as
        # torch.nn.utils.get_total_norm does with foreach; the squares summed in fp64
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        total_sq += (torch.stack(norms).double() ** 2).sum().to(device) / copies
    return total_sq


@torch.no_grad()
def clip_grads_(params: list[nn.Parameter], total_norm: torch.Tensor, max_norm: float = MAX_GRAD_NORM) -> None:
    """Scale gradients by min(1, max_norm / (total_norm + 1e-6)) on the device, one multi-tensor kernel per
    mesh (torch.nn.utils.clip_grads_with_norm_; a non-finite norm leaves NaN gradients, whose update the
    caller skips)."""
    from torch.nn.utils import clip_grads_with_norm_

    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(_mesh_key(p.grad), []).append(p)
    for group in by_mesh.values():
        clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], pp: int, max_norm: float = MAX_GRAD_NORM,
                   device: torch.device | None = None, norm_params: list[nn.Parameter] | None = None,
                   expert_holders: dict[int, int] | None = None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm; return the norm before clipping (an fp64
    0-dim tensor on `device`, never read back here).

    One all-reduce of `local_grad_norm_sq`; `norm_params` (default: params) are those the norm counts.
    The training step folds that all-reduce into its loss's (executor.train).
    """
    if device is None:
        device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    total_sq = local_grad_norm_sq(params if norm_params is None else norm_params, pp, device, expert_holders)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total_sq)
    norm = total_sq.sqrt()
    clip_grads_(params, norm, max_norm)
    return norm


def skip_update_where(optimizers: list[torch.optim.Optimizer], skip: torch.Tensor) -> None:
    """Make the next step() of every optimizer a no-op where `skip` (a 0-dim bool on the device) is true.

    Fused AdamW reads `found_inf` inside its kernel (parameters, moments and step counts unchanged when
    it is 1), so the decision stays on the device. ZeroRedundancyOptimizer and Zero1Optimizer step an
    inner `optim` (then broadcast the unchanged parameters).
    """
    flag = skip.float()
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", optimizer)
        inner.found_inf = flag
        inner.grad_scale = None  # gradients are unscaled already (unscale_and_check)


def build_scaler(plan: Plan, device: torch.device):
    """Dynamic loss scaling for fp16 on GPUs (fp16's 5-bit exponent underflows small gradients); else None.

    torch.amp.GradScaler serves FSDP2 too: its DTensor gradients all-reduce
    the inf check over their own mesh; `unscale_and_check` makes every rank
    agree across meshes and pipeline stages.
    """
    if device.type != "cuda" or plan.training.dtype != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def unscale_and_check(scaler, optimizers: list[torch.optim.Optimizer], device: torch.device) -> torch.Tensor:
    """Unscale every optimizer's gradients (before clipping); a 0-dim bool on the device, true when some rank
    found inf/nan (all on the device: no host read).

    The found-inf flags are summed over optimizers and max-reduced over the
    world and written back, so every rank skips (or takes) the step together
    and scaler.update() backs off on every rank alike.
    """
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    flags = [t for o in optimizers for t in scaler._per_optimizer_states[id(o)]["found_inf_per_device"].values()]
    found = torch.zeros((), dtype=torch.float32, device=device)
    for flag in flags:
        found += flag.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    found = found > 0
    for flag in flags:
        flag.copy_(found)
    return found
