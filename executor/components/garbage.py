"""Python's garbage collector under the training loop: off between steps, collected every N steps on all ranks.

CPython runs its cyclic collector whenever allocations pass a threshold,
which in a training step can happen on any rank at any moment; a pause of
tens of milliseconds on one rank delays every collective the others are
waiting in. torchtitan's GarbageCollection handles it by disabling automatic
collection and collecting generation 1 every `gc_freq` steps (50 by
default) on every rank at the same step, so the pauses line up. The same
here; a full collection runs once when the loop starts, and automatic
collection is restored when the loop ends.
"""

from __future__ import annotations

import gc

COLLECT_EVERY_STEPS = 50  # torchtitan's default gc_freq


class GarbageCollection:
    def __init__(self, every_steps: int = COLLECT_EVERY_STEPS) -> None:
        self.every = every_steps
        self.was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()  # what the model build left behind, before the first step

    def step(self, step: int) -> None:
        """After optimizer step `step` (the same steps on every rank): generation 1 every `every` steps."""
        if step > 1 and step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.was_enabled:
            gc.enable()
