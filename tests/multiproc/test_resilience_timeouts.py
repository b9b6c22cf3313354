"""Process-group timeouts on 2 gloo ranks (torch.multiprocessing): after `Timeouts.lower()` a collective
whose peer is late fails after the step timeout; inside `raised()` the same lateness is waited out."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.resilience.timeouts import LONG_ENV, STEP_ENV, Timeouts

STEP_S, LATE_S = 2, 5


def worker(rank: int, port: int, out: str, mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from planner.layout import MESH_AXES

    os.environ[STEP_ENV], os.environ[LONG_ENV] = str(STEP_S), "60"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    timeouts = Timeouts(init_device_mesh("cpu", (1, 1, 2, 1, 1), mesh_dim_names=MESH_AXES))
    timeouts.lower()
    if rank == 1:
        time.sleep(LATE_S)  # a slow peer: in a save, or gone
        if mode == "lowered":
            os._exit(0)  # rank 0 has given up by now; a timed-out group cannot be torn down cleanly
    started = time.monotonic()
    try:
        if mode == "raised":
            with timeouts.raised():
                dist.all_reduce(torch.ones(1))
        else:
            dist.all_reduce(torch.ones(1))
        outcome = "ok"
    except RuntimeError:
        outcome = "timed out"
    if rank == 0:
        Path(out, mode).write_text(f"{outcome} {time.monotonic() - started:.1f}")
    if outcome == "ok":
        dist.destroy_process_group()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["lowered", "raised"])
def test_step_timeout_applies_after_lower_and_not_inside_raised(tmp_path, mode):
    mp.spawn(worker, args=(free_port(), str(tmp_path), mode), nprocs=2, join=True)
    outcome, waited = (tmp_path / mode).read_text().rsplit(" ", 1)
    if mode == "lowered":
        assert outcome == "timed out" and float(waited) > STEP_S - 0.5  # gave up after the step timeout
    else:
        assert outcome == "ok" and float(waited) > LATE_S - 1  # waited the late peer out
