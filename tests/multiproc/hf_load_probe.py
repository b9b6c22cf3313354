"""One torchrun rank of tests/multiproc/test_hf_load_memory.py (not a test module): shard the plan's model on the
meta device, reset the peak resident set, load --init-from DIR, and write this rank's memory figures as JSON.

usage: torchrun --nproc-per-node N hf_load_probe.py PLAN DIR OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(plan_path: str, weights: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from executor.model import build_model
    from executor.parallel.mesh import build_mesh
    from executor.parallel.parallelize import parallelize
    from planner.plan import load_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plan = load_plan(plan_path)
    mesh = build_mesh(plan, "cpu")
    model = build_model(plan.model)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak resident set (VmHWM) restarts here
    before = status_kib("VmRSS")
    pm = parallelize(model, plan, mesh, torch.device("cpu"), init_from=weights)
    peak = status_kib("VmHWM")
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for part in pm.parts for p in part.parameters())
    rank = dist.get_rank()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rss_before_kib": before, "peak_kib": peak,
                                                         "local_param_bytes": local, "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
