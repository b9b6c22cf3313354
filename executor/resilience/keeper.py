"""The training loop's side of resilience: stop agreement, checkpoint cadence, timeouts, preemption.

The Trainer calls `resume` once, then three things per run (executor.train):

  boundary(agree)       before every step; after a step the loop read back
                        (executor.train's read steps: logging, checkpoint and
                        last steps, and at least every few seconds) it is
                        collective: one all-reduce of two small integers (the
                        strongest stop request any rank has: none, Ctrl-C,
                        SIGTERM; whether rank 0's async save has finished) and
                        its read. Ranks see signals at different moments;
                        stopping on a local flag could leave one rank in the
                        next step's collectives forever, so a signal waits for
                        the next agreed boundary; between read steps nothing
                        is read, and the device's queue never waits. A
                        finished async save is published there by every rank
                        together.
  after_step(step)      lowers the process groups' timeout after the first step
                        (executor.resilience.timeouts) and saves when due,
                        unless a non-finite streak is running
                        (executor.resilience.guard).
  finish(step, stop)    waits for an async save in flight; on SIGTERM writes the
                        checkpoint of the last finished step (synchronously,
                        under the long timeout) unless it was just written.

Checkpoints are synchronous (under the long timeout), or with --async-checkpoint
DCP's async_save over a separate gloo group (torchtitan's "async" mode): the
state is copied to host memory at the step boundary and written, hashed and
published while training goes on.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from executor.interrupt import NONE, PREEMPT, STOP_REQUESTED
from executor.resilience.timeouts import Timeouts, long_timeout
from topologies.terminal import log


class Keeper:
    def __init__(self, manager, checkpoint_every: int, asynchronous: bool, mesh, device: torch.device,
                 guard) -> None:
        self.manager, self.every, self.device, self.guard = manager, checkpoint_every, device, guard
        self.timeouts = Timeouts(mesh)
        self.rank0 = dist.get_rank() == 0
        self.first_done = False
        # DCP's async_save needs a CPU (gloo) group of its own: its background thread's collectives must not
        # interleave with the training's on the default group.
        self.async_group = (dist.new_group(backend="gloo", timeout=long_timeout())
                            if asynchronous and manager is not None and dist.get_world_size() > 1 else None)

    def boundary(self, agree: bool = True) -> int:
        """The agreed stop request (interrupt.NONE / INTERRUPT / PREEMPT); publishes a finished async save.

        agree=False (a step boundary the loop does not read at; the same on every rank): NONE, no collective.
        """
        if not agree:
            return NONE
        done = self.rank0 and self.manager is not None and self.manager.pending_done()
        flags = torch.tensor([STOP_REQUESTED["kind"], int(done)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, published = flags.tolist()  # one read
        if published:
            with self.timeouts.raised():
                self.manager.wait()
        return stop

    def save_due(self, step: int) -> bool:
        """Whether a checkpoint is due after `step` (--checkpoint-every); the guard may still forbid it."""
        return self.manager is not None and bool(self.every) and step % self.every == 0

    def stop_requested(self) -> bool:
        """This rank's own flag (no collective): for waits that should end early when a signal comes."""
        return STOP_REQUESTED["kind"] != NONE

    def after_step(self, step: int, app_state: dict) -> None:
        if not self.first_done:
            self.timeouts.lower()  # torchtitan lowers after step 1: compilation and warm-up are behind
            self.first_done = True
        if not self.save_due(step) or not self.guard.saving_allowed:
            return
        if self.async_group is not None:
            with self.timeouts.raised():  # the previous async save may still be finishing
                self.manager.save(step, app_state, asynchronous=True, group=self.async_group)
            return
        with self.timeouts.raised():
            self.manager.save(step, app_state)

    def finish(self, step: int, stop: int, app_state: dict) -> None:
        if self.manager is None:
            return
        with self.timeouts.raised():
            self.manager.wait()
            if stop != PREEMPT or step == 0 or self.manager.last_saved == step or not self.guard.saving_allowed:
                return
            started = time.monotonic()
            path = self.manager.save(step, app_state)
        if self.rank0:
            since = STOP_REQUESTED["since"]
            waited = f", {time.monotonic() - since:.1f} s after the signal" if since is not None else ""
            log(f"preempt: checkpoint {path.name} written in {time.monotonic() - started:.1f} s{waited}")


def resume(manager, app_state: dict, opts) -> int:
    """Load the newest valid checkpoint (or --resume-from's) when there is one; rebuild the LR schedule for a
    changed --steps under --allow-plan-change. Returns the step resumed (0: none)."""
    from executor.components.optim import reschedule
    from executor.resilience.checkpoints import parse_step

    step = manager.load(app_state, parse_step(opts.resume_from) if opts.resume_from else None, say_none=opts.resume)
    if step and opts.allow_plan_change:
        reschedule(app_state["train"].schedulers, step, opts.steps)
    return step
