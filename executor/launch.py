"""Launch the workers: torchrun, in-process, as torchtune's `tune run` does.

`meshplan execute` calls `torch.distributed.run.run(args)` with the argument
list a user would give torchrun, so the elastic agent (rendezvous, worker
monitoring, restarts on failure with --max-restarts) is torchrun's own:

  one node:  torchrun --standalone --nnodes 1 --nproc-per-node P
             --max-restarts R --shutdown-timeout G -m executor.worker PLAN --out DIR ...
  N nodes:   torchrun --nnodes N --nproc-per-node P
             --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID ...
             (the same command on every node; ID derives from the plan so
             all nodes agree without being told); with --replan and
             --max-restarts, --nnodes 1:N: a job that loses nodes carries on
             with the ones left, re-planned, and grows back when they return

P is the plan's ranks per node (GPUs per node; CPU ranks on the cpu
cluster); G the preemption grace (how long the agent lets workers checkpoint
after forwarding SIGTERM or SIGINT). The agent is executor.resilience.agent's.
When a worker fails torchrun stops the others and raises ChildFailedError;
it becomes one line naming the first failed rank and its error (the worker's
exit codes 2, 3 and 4 are kept; 75, preempted, is PreemptedRun). A SIGTERM
to this process (a scheduler's preemption) becomes PreemptedRun too, once the
workers have written their checkpoint.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import sys
from pathlib import Path

from executor.interrupt import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from executor.worker import allocator_env
from topologies.errors import ExecutionError, InterruptedRun, PreemptedRun

REPO_ROOT = Path(__file__).resolve().parent.parent


def torchrun_argv(nproc: int, nnodes: int, rdzv_endpoint: str | None, max_restarts: int,
                  run_id: str, worker_args: list[str], grace_s: float = 30.0, elastic: bool = False) -> list[str]:
    """torchrun's argument list for this node (see the module docstring)."""
    nodes = f"1:{nnodes}" if elastic and nnodes > 1 else str(nnodes)
    argv = [f"--nnodes={nodes}", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            f"--shutdown-timeout={math.ceil(grace_s)}"]
    if rdzv_endpoint is None:  # one node (execute refuses several without an endpoint)
        argv.append("--standalone")
    else:  # c10d assigns node ranks by arrival, so node_rank is not passed (torchrun would warn it is ignored)
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}"]
    return argv + ["-m", "executor.worker", *worker_args]


def run_id(plan_text: str) -> str:
    """A rendezvous id every node derives alike from the plan it runs."""
    return "meshplan-" + hashlib.sha256(plan_text.encode()).hexdigest()[:12]


def _worker_env(nproc: int, on_cpu: bool, run_dir: Path | None = None) -> None:
    """Make the repository importable by workers; share the cores among CPU ranks; GPU ranks get
    expandable segments (executor.worker.allocator_env) and NCCL's flight recorder dumping into
    run_dir (executor.resilience.timeouts)."""
    paths = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // nproc) if on_cpu else 1
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if not on_cpu:
        from executor.resilience.timeouts import flight_recorder_env

        allocator_env()
        if run_dir is None:
            return
        for key, value in flight_recorder_env(run_dir).items():
            os.environ.setdefault(key, value)
        Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)  # torch does not


def launch(argv: list[str], nproc: int, on_cpu: bool, run_dir: Path) -> None:
    """Run torchrun with `argv` (from torchrun_argv) in this process; raise ExecutionError on failure."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from executor.resilience.agent import meshplan_agent

    _worker_env(nproc, on_cpu, run_dir)
    sys.stdout.flush()
    # torchrun's agent logs a warning per signal and per stopped worker and an error per failed one; the verb
    # prints its own line for each (executor.resilience.agent, ChildFailedError below), and a worker's
    # traceback is on its own stderr (elastic's get_logger gives each module's logger its own level, so the
    # parent's is not enough)
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with meshplan_agent(run_dir) as own_failures:
            run(parse_args(argv))
    except RendezvousError as exc:
        raise ExecutionError(
            f"the rendezvous failed ({type(exc).__name__}: {_one_line(str(exc), 200)}): torchrun's c10d store lives "
            "in the first node's `meshplan execute`, so losing that node ends the job; start it again with --resume "
            "(and --replan for the nodes left)") from None
    except SignalException as exc:  # Ctrl-C or SIGTERM reached the agent: it forwarded it and the workers stopped
        name = getattr(exc.sigval, "name", str(exc.sigval))
        if exc.sigval == signal.SIGTERM:
            raise PreemptedRun(name) from None
        raise InterruptedRun(f"interrupted by {name}") from None
    except ChildFailedError as exc:
        rank, failure = _first_failure(exc, own_failures)
        if failure.exitcode in (INTERRUPTED_EXIT_CODE, -signal.SIGINT):
            raise InterruptedRun(f"rank {rank} was interrupted") from None
        if failure.exitcode == PREEMPTED_EXIT_CODE:
            raise PreemptedRun(f"rank {rank} got SIGTERM") from None
        error = ExecutionError(
            f"rank {rank} (local rank {failure.local_rank}) failed with exit code {failure.exitcode}: "
            f"{_one_line(failure.message)}{_hint(failure.exitcode)}"
        )
        if failure.exitcode in (2, 3, 4):
            error.exit_code = failure.exitcode
        raise error from None


def _first_failure(exc, own: dict) -> tuple[int, object]:
    """The failure to report: a worker's own exit (a meshplan error's code, a signal) before peers that died of
    it -- among the workers that ended on their own (`own`, executor.resilience.agent) when the agent saw any,
    as torchrun orders them (by time) -- unless a later one carries one of meshplan's exit codes."""
    failures = {r: f for r, f in exc.failures.items() if r in own} or exc.failures
    rank = min(failures, key=lambda r: failures[r].timestamp)
    first = failures[rank]
    ours = sorted((r, f) for r, f in failures.items() if f.exitcode in (2, 3, 4, PREEMPTED_EXIT_CODE))
    return ours[0] if ours and first.exitcode not in (2, 3, 4, PREEMPTED_EXIT_CODE) else (rank, first)


def _hint(exitcode: int) -> str:
    return " (SIGKILL: often the kernel's out-of-memory killer)" if exitcode == -9 else ""


def _one_line(message, limit: int = 400) -> str:
    """The gist of a torchrun failure message (a string, or the error file's dict) on one line."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = " ".join(str(message).split())
    if not text or text.startswith("To enable traceback"):
        return "see the worker's output above"
    return text if len(text) <= limit else text[:limit] + " ..."
