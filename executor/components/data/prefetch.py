"""The next step's batch, built off the critical path: a background thread prepares it while the step runs.

Building a batch is host work (the source's windows, the loss mask, the
global count of counted targets: `local_batch` and `counted_targets`); done
inside the step it delays the launch of the step's kernels, and copied from
pageable memory the host-to-device copy is synchronous. Here one worker
thread builds the batch of position p + G while step p runs, into pinned
memory where a CUDA device takes it (torch's caching host allocator keeps a
pinned block alive until the copies queued from it are done), and the step
copies it with non_blocking=True: the copy queues on the stream without
waiting for the host. On CPU ranks nothing is pinned and the copy is none.

Sources are pure functions of (seed, window index) (executor/components/
data/sources.py), so a batch built ahead is the batch the step would have
built; a position that was not prefetched (the first step, a resume) is
built in place.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from executor.components.data.batch import counted_targets, local_batch

HostBatch = tuple[torch.Tensor, torch.Tensor, int]  # inputs, targets (host), counted targets of the global batch


class BatchPrefetcher:
    """`get(position)`: this rank's (inputs, targets) on the device and the global batch's counted targets."""

    def __init__(self, source, global_batch: int, dp: int, dp_rank: int, device: torch.device) -> None:
        self.source, self.global_batch, self.dp, self.dp_rank, self.device = source, global_batch, dp, dp_rank, device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshplan-batch")
        self._next: tuple[int, Future[HostBatch]] | None = None

    def _build(self, position: int) -> HostBatch:
        cpu = torch.device("cpu")
        inputs, targets = local_batch(self.source, position, self.global_batch, self.dp, self.dp_rank, cpu)
        if self.pin:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs, targets, counted_targets(self.source, position, self.global_batch)

    def get(self, position: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The batch starting at sequence `position`; starts building the one after it."""
        ahead, self._next = self._next, None
        host = ahead[1].result() if ahead is not None and ahead[0] == position else self._build(position)
        self._next = (position + self.global_batch, self._pool.submit(self._build, position + self.global_batch))
        inputs, targets, counted = host
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True), counted

    def close(self) -> None:
        """Ends the worker thread (a batch being built is finished first and dropped)."""
        self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)
