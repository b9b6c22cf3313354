"""The per-rank entry point that torchrun starts: `python -m executor.worker PLAN --out DIR ...`.

`meshplan execute` (executor/launch.py) builds this command line; users
never type it. Each worker joins the process group (NCCL on cuda:LOCAL_RANK
for GPU plans, gloo for CPU ranks), builds the plan's device mesh and trains.

Failures: a meshplan error (bad data file, ...) prints one line naming the
rank and exits with its code; anything else is recorded by torchrun's
`@record` (traceback in the error file, shown by the launcher) and re-raised.
When one worker fails torchrun stops the others; collectives time out after
MESHPLAN_COLLECTIVE_TIMEOUT_S (default 600 s) so a lost peer cannot hang a
rank forever.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
from datetime import timedelta

from planner.run_flags import RunFlags
from topologies.errors import UsageError

TIMEOUT_ENV = "MESHPLAN_COLLECTIVE_TIMEOUT_S"
# torchtitan's launcher runs with expandable segments; planner.memory.reserved models the caching
# allocator that way (freed space merges within one growing segment per stream). A user's own setting wins.
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def allocator_env() -> None:
    """Set the CUDA caching allocator's configuration before torch initializes CUDA (no-op if the user set one)."""
    os.environ.setdefault(*ALLOC_CONF)


def parse_args(argv: list[str] | None = None) -> tuple[str, RunFlags]:
    """PLAN, then the run flags as `RunFlags.to_argv` wrote them (--out always given by the launcher)."""
    p = argparse.ArgumentParser(prog="executor.worker")
    p.add_argument("plan")
    a, rest = p.parse_known_args(argv)
    flags = RunFlags.from_argv(rest)
    if flags.out is None:
        raise UsageError("executor.worker needs --out DIR (meshplan execute always passes it)")
    return a.plan, flags


def _quiet_known_warnings() -> None:
    """Warnings torch prints on every rank for choices made on purpose here."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 root output: never modified in place
    warnings.filterwarnings("ignore", message=".*sequential all_gather operations.*")  # FSDP+TP full_tensor in tests


def _rendezvous(timeout: timedelta) -> dict:
    """init_process_group's store, rank and world size: torchrun's store under a per-attempt prefix.

    After a restart (--max-restarts) torchrun hands the new workers the same
    agent store, which still holds the dead workers' gloo addresses; without
    a prefix the new ranks read them and fail with "connection refused"
    (seen with torch 2.13). Outside torchrun: the default env:// rendezvous.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world = int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"meshplan/attempt-{attempt}", base), "rank": int(os.environ["RANK"]),
            "world_size": world}


def run(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from executor.parallel.mesh import backend_for, build_mesh, device_type_for, local_device
    from executor.train import train
    from planner.plan import load_plan

    plan_path, opts = parse_args(argv)
    plan = load_plan(plan_path)
    device_type = device_type_for(plan)
    device = local_device(device_type)
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
    dist.init_process_group(backend_for(device_type), timeout=timeout, **_rendezvous(timeout),
                            device_id=device if device_type == "cuda" else None)
    try:
        train(plan, opts, build_mesh(plan, device_type), device)
        gc.collect()  # free DDP/FSDP state (reference cycles) while its process groups still exist
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from executor import interrupt

    interrupt.install()  # first: torch's imports take seconds, and Ctrl-C may come during them
    allocator_env()  # before any CUDA allocation (exported torchrun commands start workers directly)
    from torch.distributed.elastic.multiprocessing.errors import record

    from topologies.errors import MeshplanError

    _quiet_known_warnings()
    try:
        record(run)(argv)
    except MeshplanError as exc:
        rank = os.environ.get("RANK", "?")
        sys.stderr.write(f"rank {rank}: error: {exc}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # the agreed stop: summary written by rank 0, the launcher prints the one line
        sys.exit(interrupt.INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
    main()
