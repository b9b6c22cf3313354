"""The per-rank entry point that torchrun starts: `python -m executor.worker PLAN --out DIR ...`.

`meshplan execute` (executor/launch.py) builds this command line; users
never type it. Each worker joins the process group (NCCL on cuda:LOCAL_RANK
for GPU plans, gloo for CPU ranks), builds the plan's device mesh and trains.

Failures: a meshplan error (bad data file, ...) prints one line naming the
rank and exits with its code; anything else is recorded by torchrun's
`@record` (traceback in the error file, shown by the launcher) and re-raised.
When one worker fails torchrun stops the others; collectives time out
(executor.resilience.timeouts: long for start-up, the first step and saves,
shorter afterwards) so a lost peer cannot hang a rank forever. A preempted
worker (SIGTERM; its checkpoint written) exits PREEMPTED_EXIT_CODE quietly.

When torchrun's elastic rendezvous gives the job another number of ranks than
the plan's (a node lost or back, with --replan --max-restarts), rank 0
re-plans for the ranks present (planner.search.replan) and every rank builds
that plan's mesh; the checkpoint then loads resharded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from datetime import timedelta

from planner.run_flags import RunFlags
from topologies.errors import UsageError

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
    """init_process_group's store, rank and world size: torchrun's store under a per-generation prefix.

    After a restart (--max-restarts) torchrun hands the new workers the same
    agent store, which still holds the dead workers' gloo addresses; without
    a prefix the new ranks read them and fail with "connection refused"
    (seen with torch 2.13). The prefix is the rendezvous generation every
    node's agent agrees on (executor.resilience.agent), not the restart count,
    which differs between nodes. Outside torchrun: the default env:// rendezvous.
    """
    import torch.distributed as dist

    from executor.resilience.agent import GENERATION_ENV

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world = int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    generation = os.environ.get(GENERATION_ENV) or "attempt-" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"meshplan/{generation}", base), "rank": int(os.environ["RANK"]),
            "world_size": world}


def _plan_for_world(plan, opts: RunFlags):
    """The plan to run: as given, or re-planned by rank 0 for the ranks torchrun gave (see the module docstring)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == plan.world_size:
        return plan
    if not opts.replan:
        raise UsageError(f"torchrun started {world} ranks but the plan has {plan.world_size}: pass --replan to "
                         f"re-plan for the ranks present, or launch {plan.world_size}")
    from executor.resilience.agree import broadcast
    from planner.plan import Plan
    from topologies.errors import MeshplanError

    answer = None  # rank 0's new plan as JSON text, or its error: every rank raises it, none waits alone
    if dist.get_rank() == 0:
        try:
            answer = ("plan", _replan_here(plan, opts, world))
        except MeshplanError as exc:
            answer = ("error", exc.exit_code, str(exc))
    answer = broadcast(answer)
    if answer[0] == "error":
        error = MeshplanError(answer[2])
        error.exit_code = answer[1]
        raise error
    return Plan.from_json(json.loads(answer[1]))


def _replan_here(plan, opts: RunFlags, world: int) -> str:
    """Rank 0: re-plan for this job's nodes x ranks per node, say so, write OUT/plan.json; the plan's JSON."""
    from planner.search.replan import replan
    from topologies.terminal import dumps_json, log

    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    result = replan(plan, nodes, per_node)
    for line in result.lines():
        log(line)
    result.new.save(opts.out_dir / "plan.json")
    return dumps_json(result.new.to_json())


def run(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from executor.parallel.mesh import backend_for, build_mesh, device_type_for, local_device
    from executor.resilience.timeouts import long_timeout
    from executor.train import train
    from planner.plan import load_plan
    from topologies.errors import MeshplanError

    plan_path, opts = parse_args(argv)
    plan = load_plan(plan_path)
    device_type = device_type_for(plan)
    device = local_device(device_type)
    timeout = long_timeout()
    dist.init_process_group(backend_for(device_type), timeout=timeout, **_rendezvous(timeout),
                            device_id=device if device_type == "cuda" else None)
    stopped = None
    try:
        plan = _plan_for_world(plan, opts)
        train(plan, opts, build_mesh(plan, device_type), device)
    except (MeshplanError, KeyboardInterrupt) as exc:  # understood stops: exit with their code, below
        stopped = exc.with_traceback(None)  # its frames hold the model: let them go before the groups do
    try:
        gc.collect()  # free DDP/FSDP state (reference cycles) while its process groups still exist
        if stopped is None:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if stopped is not None:
        raise stopped


def main(argv: list[str] | None = None) -> None:
    from executor import interrupt

    interrupt.install()  # first: torch's imports take seconds, and Ctrl-C may come during them
    allocator_env()  # before any CUDA allocation (exported torchrun commands start workers directly)
    from torch.distributed.elastic.multiprocessing.errors import record

    from topologies.errors import MeshplanError, NonFiniteError, PreemptedRun

    _quiet_known_warnings()
    try:
        record(run)(argv)
    except PreemptedRun:  # its checkpoint written; rank 0 said so, the launcher prints the one line
        sys.exit(interrupt.PREEMPTED_EXIT_CODE)
    except MeshplanError as exc:
        if not isinstance(exc, NonFiniteError):  # the same on every rank: the launcher prints it once
            sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: {exc.label}{exc}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # the agreed stop: summary written by rank 0, the launcher prints the one line
        sys.exit(interrupt.INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
    main()
