"""Process-group timeouts on 2 gloo ranks (torch.multiprocessing): inside `Timeouts.raised()` a late peer is
waited out; after `lower()` the same lateness makes the collective fail after the step timeout."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.resilience.timeouts import LONG_ENV, STEP_ENV, Timeouts

STEP_S, LATE_S = 2, 5


def _all_reduce_timed() -> str:
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        outcome = "ok"
    except RuntimeError:
        outcome = "timed-out"
    return f"{outcome} {time.monotonic() - started:.1f}"


def worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from planner.layout import MESH_AXES

    os.environ[STEP_ENV], os.environ[LONG_ENV] = str(STEP_S), "60"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    timeouts = Timeouts(init_device_mesh("cpu", (1, 1, 2, 1, 1), mesh_dim_names=MESH_AXES))
    timeouts.lower()
    with timeouts.raised():  # a synchronous save: the slow peer is waited for
        if rank == 1:
            time.sleep(LATE_S)
        raised = _all_reduce_timed()
    if rank == 1:
        time.sleep(LATE_S)  # a peer gone (or hung) in a training step
        os._exit(0)  # rank 0 has given up by now; a timed-out group cannot be torn down cleanly
    lowered = _all_reduce_timed()
    Path(out, "result").write_text(f"{raised} {lowered}")
    os._exit(0)


def test_late_peer_is_waited_for_inside_raised_and_times_out_after_lower(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    raised, raised_s, lowered, lowered_s = (tmp_path / "result").read_text().split()
    assert raised == "ok" and float(raised_s) > LATE_S - 1  # waited the late peer out
    assert lowered == "timed-out" and float(lowered_s) > STEP_S - 0.5  # gave up after the step timeout
