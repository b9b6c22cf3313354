"""The training loop of one rank: build, (resume,) step, report, checkpoint.

One optimizer step consumes one global batch (executor/components/data/):
  * without PP, grad_accum_steps micro-steps of micro_batch_size sequences;
    gradient sync (DDP all-reduce, FSDP2 reduce-scatter) is skipped on all
    but the last micro-step (DDP no_sync, FSDP2/replicate
    set_requires_gradient_sync(False));
  * with PP, the schedule runs the same micro-batches through the stages;
then gradients are clipped to a global norm of 1 (executor/components/optim.py), AdamW
steps and the LR schedule advances.

The determinism contract: the update is the gradient of the global-batch mean
loss over the targets the loss counts (all of them for plain text; only
completions and assistant turns for prompt/completion and chat data), whatever
the layout. Counted targets are not spread evenly over micro-batches, data-
parallel ranks or context-parallel shards, so a per-micro-batch mean would
weigh them unevenly. Instead each micro-batch's summed loss is multiplied by
D / N, where N is the global batch's count of counted targets (every rank
reads it from the data, executor.components.data.counted_targets) and D =
dp * cp the number of data shards whose gradients the data-parallel reduction
averages (DDP, FSDP2, the expert gradients); the sum over shards of D / N *
their summed losses, averaged over D, is the global mean.

The reported loss is that same global mean: each rank holding the last
pipeline stage returns its D / N-weighted sum; one all-reduce over the world
divided by world / pp = D * tp (TP ranks of a replica hold equal copies)
gives it. The same all-reduce sums the squared gradient norm's shares
(executor.components.optim.local_grad_norm_sq).

No host stalls: a step reads nothing back from the device. The loss and the
gradient norm stay there; clipping, the non-finite guard's skip (fused
AdamW's found_inf: executor.resilience.guard) and the fp16 scaler's checks
are device operations; the next batch is built by a background thread
(executor.components.data.prefetch). The loop reads on "read steps" only:
the logging steps (the first, every --log-every and the last), checkpoint
and --save-hf-every steps, and at least every READ_EVERY_S seconds of
training (the cadence is set from the last window's agreed step time, so
every rank reads at the same steps). There the pending records are read in
one go (executor.components.metrics.MetricsWindow), the guard replays them,
rank 0 writes them, and at the next step boundary the ranks agree on a stop
request (executor.resilience.keeper). Python's garbage collector runs every
50 steps on all ranks together (executor.components.garbage).

Checkpoints (executor/components/checkpoint.py): every worker that starts
loads the newest valid checkpoint of its run directory when there is one
(after --resume, a torchrun restart on any node, a resume with --replan),
whatever its restart count; every --checkpoint-every steps one is saved.
`app_state` is {"model": [parts], "optim": [one optimizer per part], "train":
TrainState}. A step whose loss or gradient norm is not finite skips its
update (executor.resilience.guard); stop requests, checkpoint cadence,
timeouts and preemption's last checkpoint are executor.resilience.keeper's.

Test-only hooks (executor.faults): `poison` after the backward, `after_step`
after every step (and its checkpoint, if one is due).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from executor import faults
from executor.components.data import open_source, run_tokenizer
from executor.components.data.prefetch import BatchPrefetcher
from executor.components.float8 import check_device, precompute_scales
from executor.components.garbage import GarbageCollection
from executor.components.metrics import (
    MetricsLog,
    MetricsWindow,
    ProgressLine,
    read_metrics,
    summarize,
    write_summary,
)
from executor.components.optim import (
    MAX_GRAD_NORM,
    build_optimizers,
    build_scaler,
    build_scheduler,
    clip_grads_,
    default_lr,
    local_grad_norm_sq,
    skip_update_where,
    unique_params,
    unscale_and_check,
)
from executor.hf.save import save_hf_due, save_hf_if_due
from executor.interrupt import INTERRUPT, NONE
from executor.model import build_model
from executor.parallel.context import shard_sequence
from executor.parallel.mesh import dp_rank
from executor.parallel.parallelize import ParallelModel, parallelize
from executor.parallel.pipeline import TiedGradSync, build_schedule, make_stages
from executor.resilience.guard import NonFiniteGuard
from executor.resilience.keeper import Keeper, resume
from planner.plan import Plan
from planner.run_flags import RunFlags
from topologies.errors import PreemptedRun

# The longest stretch of training between two host reads (stop agreement, metrics): bounds how long a
# SIGTERM or Ctrl-C waits for its step boundary when --log-every is large.
READ_EVERY_S = 5.0

# What `meshplan execute` passes to every worker: one codec for the CLI, the launch and the worker.
RunOptions = RunFlags


class TrainState(Stateful):
    """Step, data position (sequences consumed), LR schedule and RNG: what a resume needs besides weights."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        self.schedulers = schedulers
        self.step = 0
        self.data_position = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "data_position": self.data_position,
                "lr_scheduler": self.schedulers[0].state_dict(), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["lr_scheduler"])
        torch.set_rng_state(state["rng"])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32.

    Under loss parallel the logits are a DTensor split by vocabulary and
    torch's loss_parallel context computes the softmax from per-rank maxima
    and sums (no rank ever holds the full vocabulary); the loss is then a
    replicated DTensor.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the counted targets (IGNORE_INDEX skipped), in fp32.

    The training step scales it by D / N (module docstring); torch's loss_parallel
    computes a sum on any mesh (its mean only on a one-dimensional one).
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain detached tensor (a DTensor's full value)."""
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _autocast(pm: ParallelModel, device: torch.device):
    if pm.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=pm.autocast_dtype)


def _loss_parallel(pm: ParallelModel):
    """torch's loss_parallel context (forward loss and backward both inside it) when the logits are sharded."""
    if not pm.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


class AccumulationStep:
    """One optimizer step's forward/backward without PP: grad_accum_steps micro-steps."""

    def __init__(self, pm: ParallelModel, n_micro: int, device: torch.device,
                 before_micro_batch: Callable[[int], None] | None = None) -> None:
        self.pm, self.n, self.device = pm, n_micro, device
        self.runner = pm.runners[0]
        self.scaler = None  # fp16: torch.amp.GradScaler scaling the backward (set by the Trainer)
        # validate-memory resets PyTorch's module-level memory tracker between micro-batches
        self.before_micro_batch = before_micro_batch

    def _sync(self, last: bool):
        """DDP and replicate all-reduce once, after the last micro-batch; FSDP2 reduce-scatters every one,
        and under HSDP all-reduces the accumulated shards across replicas after the last only.

        Reducing each micro-batch's gradients as torchtitan does keeps only
        the sharded fp32 accumulation between micro-batches, instead of
        every unsharded gradient.
        """
        if self.pm.dp_kind == "ddp" and not last:
            return self.runner.no_sync()
        if self.pm.dp_kind == "replicate" and self.n > 1:
            self.runner.set_requires_gradient_sync(last)
        if self.pm.dp_kind == "fsdp" and self.n > 1:  # HSDP: the shards all-reduce over replicas once per step
            self.runner.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the sum of their weighted losses.

        weight: D / N (module docstring); None weighs every local target alike
        (the local mean), for callers without a global count.
        """
        weight = 1.0 / targets.numel() if weight is None else weight
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(self.n), targets.chunk(self.n), strict=True)):
            if self.before_micro_batch is not None:
                self.before_micro_batch(i)
            with self._sync(i == self.n - 1), _loss_parallel(self.pm):
                with _autocast(self.pm, self.device):
                    loss = lm_loss_sum(self.runner(x), y) * weight
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss_value(loss)
        return total


class PipelineStep:
    """One optimizer step through the pipeline schedule; the loss lives on the last stage's ranks."""

    def __init__(self, pm: ParallelModel, plan: Plan, mesh, device: torch.device, scaler=None) -> None:
        layout = plan.layout
        self.pm, self.device, self.scaler = pm, device, scaler
        self.weight = 1.0  # D / N of the step being run (module docstring), read by the loss function
        self.step_losses: list[torch.Tensor] = []  # the weighted losses of the step being run, unscaled
        self.schedule = build_schedule(make_stages(pm.runners, pm.stages, layout, mesh, device), layout,
                                       self._loss, scale_grads=False)
        self.has_first = 0 in pm.stages
        self.has_last = layout.pp * layout.virtual_stages - 1 in pm.stages

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = lm_loss_sum(out, target) * self.weight
        self.step_losses.append(loss_value(loss))  # unscaled: no read of the fp16 scale back to the host
        return loss if self.scaler is None else self.scaler.scale(loss)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor | None:
        """One step of the schedule; on the last stage's ranks, the sum of the micro-batches' weighted losses."""
        self.weight, self.step_losses = weight, []
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        with _autocast(self.pm, self.device), _loss_parallel(self.pm):
            self.schedule.step(*args, return_outputs=False, **kwargs)  # the last stage keeps no logits
        if not self.has_last:
            return None
        # the micro-batches' losses are the last len(losses) calls (the first step's shape inference calls the
        # loss function once more, on uninitialized outputs)
        return torch.stack(self.step_losses[len(self.step_losses) - len(losses):]).sum()


def _checkpoint_manager(opts: RunOptions, plan: Plan):
    """executor.components.checkpoint's CheckpointManager: every run has one (a restart or a preemption may
    need it); its directory is made now only when checkpoints are asked for."""
    from executor.components.checkpoint import CheckpointManager
    from executor.resilience.contract import run_info

    return CheckpointManager(opts.out_dir, keep=opts.keep_checkpoints, run_info=run_info(plan, opts.steps),
                             create=bool(opts.checkpoint_every))


class Trainer:
    """One rank's run: the parallel model, optimizers, state, data and reporting, built once."""

    def __init__(self, plan: Plan, opts: RunOptions, mesh, device: torch.device) -> None:
        layout = plan.layout
        self.plan, self.opts, self.device = plan, opts, device
        if plan.training.fp8:
            check_device(device)
        self.pm = parallelize(build_model(plan.model), plan, mesh, device, seed=opts.seed,
                              compile=opts.compile or getattr(plan.training, "compile", False),
                              init_from=opts.weights_source)
        lr = opts.lr if opts.lr is not None else default_lr(plan.model.hidden)
        self.optimizers = build_optimizers(self.pm.parts, plan, mesh, lr)
        self.state = TrainState([build_scheduler(o, opts.steps) for o in self.optimizers])
        self.app_state = {"model": self.pm.parts, "optim": self.optimizers, "train": self.state}
        self.manager = _checkpoint_manager(opts, plan)
        resume(self.manager, self.app_state, opts)
        self.scaler = build_scaler(plan, device)
        self.guard = NonFiniteGuard(opts.max_nonfinite_steps, count_grad_norm=self.scaler is None,
                                    verbose=dist.get_rank() == 0)
        self.keeper = Keeper(self.manager, opts.checkpoint_every, opts.async_checkpoint, mesh, device, self.guard)
        self.step_fn = (PipelineStep(self.pm, plan, mesh, device, self.scaler) if layout.pp > 1
                        else AccumulationStep(self.pm, layout.grad_accum_steps, device))
        self.step_fn.scaler = self.scaler
        self.source = open_source(opts.data, plan.model.vocab, plan.training.seq_len, opts.seed,
                                  tokenizer=run_tokenizer(opts))
        self.data_shards = layout.dp * layout.cp  # D: the shards the data-parallel reduction averages
        self.dp_index = dp_rank(mesh)
        self.batches = BatchPrefetcher(self.source, plan.training.global_batch_size, layout.dp, self.dp_index,
                                       device)
        self.params = unique_params(self.pm.parts)
        self.tied = (TiedGradSync(self.pm.parts, self.pm.stages, layout, mesh)
                     if layout.pp > 1 and plan.model.tie_embeddings else None)
        skip = self.tied.norm_skip if self.tied is not None else set()
        self.norm_params = [p for p in self.params if id(p) not in skip]
        experts = self.pm.experts
        self.expert_holders = {id(p): experts.holders for p in self.pm.expert_params} if experts else None
        self.window = MetricsWindow(plan, device, plan.cluster.gpu.peak_flops(_flops_dtype(plan, device)))
        self.first_step = self.state.step + 1  # this process's first step: a window of its own (warm-up)
        self.read_by: int | None = None  # READ_EVERY_S's bound on the next read step, once a window is timed

    def step(self) -> dict:
        """One optimizer step on the next global batch, queued without reading anything back from the device.

        Returns the step's pending record (loss and grad_norm as device tensors), also kept by self.window
        until the loop reads it (module docstring).
        """
        plan, state = self.plan, self.state
        self.window.begin_step()
        batch = plan.training.global_batch_size
        inputs, targets, counted = self.batches.get(state.data_position)
        if self.pm.cp is not None:  # this rank's two load-balanced chunks of every sequence
            inputs, targets = shard_sequence(inputs, self.pm.cp), shard_sequence(targets, self.pm.cp)
        lr = state.schedulers[0].get_last_lr()[0]
        weight = self.data_shards / max(counted, 1)  # nothing counted: no gradient
        loss = faults.poison(state.step + 1, self.step_fn(inputs, targets, weight), self.params)
        if self.tied is not None:
            self.tied()
        if self.pm.experts is not None:
            self.pm.experts.reduce_grads(self.pm.expert_params)
        overflow = unscale_and_check(self.scaler, self.optimizers, self.device) if self.scaler is not None else None
        mean_loss, grad_norm = self._reduce(loss)
        clip_grads_(self.params, grad_norm, MAX_GRAD_NORM)
        skip = self.guard.skip(mean_loss, grad_norm)  # the same on every rank: both reduced
        skip_update_where(self.optimizers, skip if overflow is None else skip | overflow)
        for optimizer, scheduler in zip(self.optimizers, state.schedulers, strict=True):
            optimizer.step()  # a no-op on the device where `skip`
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if self.scaler is not None:
            self.scaler.update()  # backs off on the overflow unscale_and_check found
        if self.pm.float8_all_gather:  # torchtitan's post-optimizer hook: scales for the next all-gathers
            precompute_scales(self.pm.parts)
        state.step, state.data_position = state.step + 1, state.data_position + batch
        self.window.add(state.step, lr, mean_loss, grad_norm)
        return {"step": state.step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm}

    def _reduce(self, loss: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(global-batch mean loss, global gradient norm before clipping), fp64 on the device: one all-reduce
        of this rank's loss share (module docstring) and squared-norm share."""
        shares = torch.zeros(2, dtype=torch.float64, device=self.device)
        shares[0] = local_grad_norm_sq(self.norm_params, self.plan.layout.pp, self.device, self.expert_holders)
        if loss is not None:
            shares[1] = loss.detach().double() / (dist.get_world_size() // self.plan.layout.pp)
        dist.all_reduce(shares)
        return shares[1], shares[0].sqrt()

    def _read_due(self, step: int) -> bool:
        """Whether the loop reads back at this step (module docstring); the same answer on every rank."""
        opts = self.opts
        return (step == self.first_step or step % max(1, opts.log_every) == 0 or step == opts.steps
                or self.keeper.save_due(step) or save_hf_due(opts, step)
                or (self.read_by is not None and step >= self.read_by))

    def _read(self, step: int, log: MetricsLog | None, progress: ProgressLine | None) -> None:
        """Reads the pending records back, replays them through the non-finite guard (which may stop the run
        here, before the offending step's record is written) and has rank 0 write them."""
        records = self.window.read()
        for record in records:
            self.guard.admit(record["step"], record["loss"], record["grad_norm"])
            record = self.guard.annotate(record)
            if log is not None:
                log.write(record)
                progress.update(record)
        if self.window.mean_step_s:  # the agreed step time: the same bound on every rank. After the first step
            # (a window of its own, warm-up included) the bound comes early; the next window's time sets it right
            self.read_by = step + max(1, int(READ_EVERY_S / self.window.mean_step_s))

    def run(self) -> None:
        """Steps until opts.steps (or an agreed stop on SIGINT/SIGTERM); rank 0 logs each and writes summary.json."""
        opts, rank0 = self.opts, dist.get_rank() == 0
        log = MetricsLog(opts.out_dir, append=self.state.step > 0) if rank0 else None
        progress = ProgressLine(opts.steps, self.state.step + 1, opts.log_every) if rank0 else None
        stop, read = NONE, True
        collector = GarbageCollection()
        try:
            while self.state.step < opts.steps:
                stop = self.keeper.boundary(agree=read)  # after a read step only: no read in between
                if stop != NONE:
                    break
                self.step()
                step = self.state.step
                read = self._read_due(step)
                if read:
                    self._read(step, log, progress)
                self.keeper.after_step(step, self.app_state)
                save_hf_if_due(self.pm.parts, self.plan.model, opts, step)
                faults.after_step(step, dist.get_rank(), self.keeper.stop_requested)
                collector.step(step)
        finally:
            collector.close()
            self.batches.close()
            if progress is not None:
                progress.close()
        self.keeper.finish(self.state.step, stop, self.app_state)
        if rank0 and log.path.exists() and log.path.stat().st_size:
            write_summary(opts.out_dir, summarize(self.plan, read_metrics(log.path), _device_name(self.device),
                                                  interrupted_at_step=self.state.step if stop != NONE else None))
        if stop != NONE:
            dist.barrier()  # the summary is written before any rank exits (a scheduler may kill the rest then)
            raise KeyboardInterrupt if stop == INTERRUPT else PreemptedRun(f"preempted at step {self.state.step}")


def train(plan: Plan, opts: RunOptions, mesh, device: torch.device) -> None:
    """Run the plan on this rank up to opts.steps optimizer steps (every rank calls it)."""
    Trainer(plan, opts, mesh, device).run()


def _device_name(device: torch.device) -> str:
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"


def _flops_dtype(plan: Plan, device: torch.device) -> str:
    """The dtype whose peak FLOP/s MFU divides by: what the matmuls run in."""
    return "fp32" if device.type == "cpu" else plan.training.dtype
