"""How long a collective may wait for a peer, and what NCCL leaves behind when one never comes.

A rank that is gone (a lost node, a hung GPU) is noticed only when a
collective times out, so the timeout is how long a failed job sits idle
before torchrun can restart it. The first step (compilation, allocator
warm-up, lazy initialization) and synchronous checkpoint saves and loads
may legitimately keep a rank away for minutes; a training step may not. So,
as torchtitan does (init_timeout_seconds, then set_pg_timeouts with
train_timeout_seconds after step 1): process groups start with the long
timeout (MESHPLAN_COLLECTIVE_TIMEOUT_S, default 600 s), are lowered to
MESHPLAN_STEP_TIMEOUT_S (default 300 s) after a barrier once the first step
is done, and raised again around every synchronous save. The barrier keeps a
fast rank from waiting with the short timeout on a slow one still working
under the long one.

NCCL runs also get PyTorch's flight recorder (TORCH_FR_BUFFER_SIZE entries of
the last collectives per rank, dumped to OUT/comm_traces/rank_<N> when the
watchdog sees a timeout: TORCH_NCCL_DUMP_ON_TIMEOUT; which rank stopped
issuing collectives is then visible with `torchfrtrace`), with
TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (the watchdog kills the process without
tearing down the communicator, which the dump needs; torchtitan's setting).
A user's own setting of any of these wins.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

LONG_ENV = "MESHPLAN_COLLECTIVE_TIMEOUT_S"
STEP_ENV = "MESHPLAN_STEP_TIMEOUT_S"
LONG_S = 600.0
STEP_S = 300.0
FLIGHT_RECORDER_ENTRIES = 20000  # torchtitan's comm.trace_buf_size
TRACES_DIR = "comm_traces"


def long_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(LONG_ENV, LONG_S)))


def step_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(STEP_ENV, STEP_S)))


def flight_recorder_env(out_dir: Path) -> dict[str, str]:
    """The environment NCCL workers start with (the launcher sets it; see the module docstring)."""
    return {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(out_dir.resolve() / TRACES_DIR / "rank_"),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


class Timeouts:
    """The process groups of one rank's mesh, switched between the long and the step timeout."""

    def __init__(self, mesh) -> None:
        import torch.distributed as dist

        from executor.parallel.mesh import dp_flat, grad_flat, shard_mesh

        self.groups = [None]  # the default (world) group, then every axis group and flattened one of the mesh
        for m in (mesh, dp_flat(mesh), grad_flat(mesh), shard_mesh(mesh)):
            self.groups += [g for g in m.get_all_groups() if g not in self.groups]
        self.dist = dist
        self.current = long_timeout()

    def _set(self, timeout: timedelta) -> None:
        # torch 2.13 has no public setter (later releases add torch.distributed.set_timeout, torchtitan's call)
        from torch.distributed.distributed_c10d import _set_pg_timeout

        if timeout == self.current:
            return
        for group in self.groups:
            _set_pg_timeout(timeout, group)
        self.current = timeout

    def lower(self) -> None:
        """Every rank reached this point (barrier under the long timeout), then the step timeout applies."""
        if self.current == step_timeout():
            return
        self.dist.barrier()
        self._set(step_timeout())

    @contextlib.contextmanager
    def raised(self):
        """The long timeout for what is inside (a synchronous save or load); the step timeout after it.

        Not after an exception: lowering takes a barrier, and a rank on its way out must not enter a collective
        its peers may match with one of theirs (a rank failing inside a save would let the others publish it).
        """
        lowered = self.current != long_timeout()
        self._set(long_timeout())
        yield
        if lowered:
            self.lower()
