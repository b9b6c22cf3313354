"""Non-finite steps: skip the update, count it, stop after too many in a row.

A NaN or infinite loss (or gradient norm) means the update would write NaN
into every parameter and every later checkpoint. The guard looks at the two
numbers every rank already agrees on (the global-batch loss and the global
gradient norm are both all-reduced), so all ranks decide alike without a
collective of their own: the optimizer step is skipped (the LR schedule and
the data still advance: that batch is not retried, it would fail again),
the step's record says so, and after `limit` such steps in a row the run
stops with NonFiniteError (exit 4). While a streak is running no checkpoint
is written, so `latest` keeps naming the state from before it.

Two halves, so that the step never waits for the device:
  * on the device, every step (`skip`): the update is skipped where the
    step is non-finite, or once `limit` non-finite steps came in a row (the
    streak latches: no update after it, whatever follows), through fused
    AdamW's found_inf (executor.components.optim.skip_update_where);
  * on the host, when the loop reads its records back (logging steps,
    checkpoint steps, the last step: executor.components.metrics.
    MetricsWindow), `admit` replays those records in order: it counts,
    reports each skip and raises NonFiniteError at the limit'th bad step
    in a row, before that step's record is written.
So --max-nonfinite-steps N stops the run at the first read at or after the
N-th non-finite step in a row; the steps run in between change nothing (their
updates are skipped), the parameters stay those of the step before the
streak, and no checkpoint is written in between (a checkpoint step reads
first).

Under fp16's dynamic loss scaling an overflowing gradient is the scaler's
business (it skips the step and lowers the scale, routinely at the start):
only a non-finite loss counts there.
"""

from __future__ import annotations

import math

import torch

from topologies.errors import NonFiniteError


class NonFiniteGuard:
    def __init__(self, limit: int, count_grad_norm: bool = True, verbose: bool = False) -> None:
        self.limit = limit
        self.count_grad_norm = count_grad_norm
        self.verbose = verbose  # rank 0 says each skip on the console
        self.in_a_row = 0
        self.skipped = 0  # over this process's life
        self.streak: list[int] = []
        self._run_on_device: torch.Tensor | None = None  # non-finite steps in a row, on the device
        self._latched: torch.Tensor | None = None  # the limit was reached: no update until the host stops the run

    def skip(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """This step's skip decision on the device (0-dim bool; the same on every rank: both inputs reduced)."""
        bad = ~torch.isfinite(loss)
        if self.count_grad_norm:
            bad = bad | ~torch.isfinite(grad_norm)
        if self._run_on_device is None:
            self._run_on_device = torch.zeros((), dtype=torch.int64, device=loss.device)
            self._latched = torch.zeros((), dtype=torch.bool, device=loss.device)
        self._run_on_device = torch.where(bad, self._run_on_device + 1, torch.zeros_like(self._run_on_device))
        self._latched = self._latched | (self._run_on_device >= self.limit)
        return bad | self._latched

    def admit(self, step: int, loss: float, grad_norm: float) -> bool:
        """Replays one step read back on the host: True when its update was taken, False when skipped. Raises
        NonFiniteError at the limit'th bad step in a row (the device skipped every update since)."""
        bad = not math.isfinite(loss) or (self.count_grad_norm and not math.isfinite(grad_norm))
        if not bad:
            self.in_a_row, self.streak = 0, []
            return True
        self.in_a_row += 1
        self.skipped += 1
        self.streak.append(step)
        if self.verbose and self.in_a_row < self.limit:
            from topologies.terminal import log

            log(f"step {step}: loss {loss}, gradient norm {grad_norm}: update skipped ({self.in_a_row} in a row; "
                f"{self.limit} stop the run)")
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"steps {', '.join(map(str, self.streak))}: the loss ({loss}) or the gradient norm ({grad_norm}) was "
                f"not finite {self.in_a_row} times in a row (--max-nonfinite-steps {self.limit}); the run stops with "
                f"the parameters of step {self.streak[0] - 1} and no checkpoint after it: resume from the latest "
                "checkpoint with a lower --lr, or check the data of those steps")
        return False

    @property
    def saving_allowed(self) -> bool:
        """No checkpoint during a streak: `latest` keeps naming the state from before it."""
        return self.in_a_row == 0

    def annotate(self, record: dict) -> dict:
        """The step's metrics record: non-finite values as null (JSON has no NaN) and the skip, if any."""
        if self.in_a_row == 0:
            return record
        record = {**record, "skipped_update": True, "nonfinite_in_a_row": self.in_a_row}
        for key in ("loss", "grad_norm"):
            if not math.isfinite(record[key]):
                record[key] = None
        return record
