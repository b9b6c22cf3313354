"""torchrun's elastic agent, with what restarts across nodes need.

`meshplan execute` runs torchrun in-process (executor.launch); `meshplan_agent()`
makes torch's launcher build this LocalElasticAgent subclass instead of its
own for that call (torch's launch_agent takes no agent class, so the name it
uses is swapped for the duration). Four changes:

  * Rendezvous generation. torchelastic raises TORCHELASTIC_RESTART_COUNT only
    on the node whose worker failed; a healthy node whose workers are restarted
    because another node re-joined keeps its count. Keyed by that count, the
    workers of one restart read different store keys (and a healthy node's
    workers a previous generation's: "Connection refused"). Here group rank 0's
    agent draws a fresh token after every rendezvous and every agent reads it
    from the rendezvous round's own store; workers get it as MESHPLAN_GENERATION
    and key their process-group store by it (executor.worker).
  * One line per restart: which rank died and how (exit code and its error, or
    the signal), or that another node's failure restarts this one; and the
    checkpoint the new workers resume from.
  * No restart after a failure a restart would repeat: a usage error (exit 2),
    no layout (3), the non-finite stop (4), a preemption (75), Ctrl-C (130).
  * Once a worker crashes, its node's other workers are killed (SIGKILL), not
    sent SIGTERM: they are blocked in collectives with a dead peer, and SIGTERM
    would ask them to checkpoint (executor.interrupt), which they cannot;
    torchrun would wait 30 s before killing them anyway (NCCL would not even
    notice the dead peer before its timeout). The workers that ended on their
    own, before that kill, are the ones the restart line names. A worker that
    ends preempted (75) or interrupted (130) leaves its peers alone: they are
    finishing the same checkpoint. Ctrl-C and a SIGTERM to the agent itself
    still reach the workers as signals (torchrun's own shutdown).
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from executor.resilience.checkpoints import CHECKPOINTS, latest_step
from topologies.terminal import log

GENERATION_ENV = "MESHPLAN_GENERATION"
GENERATION_KEY = "meshplan/generation"
FINAL_EXIT_CODES = {2: "usage error", 3: "no feasible layout", 4: "non-finite loss or gradients",
                    75: "preempted", 130: "interrupted"}
GRACEFUL_EXIT_CODES = {75, 130}  # its peers are stopping the same way: let them finish


class MeshplanAgent(LocalElasticAgent):
    run_dir: Path = Path(".")  # set by meshplan_agent()

    def _rendezvous(self, worker_group) -> None:
        super()._rendezvous(worker_group)
        store = worker_group.store  # prefixed by the rendezvous round: a fresh key space every round
        if worker_group.group_rank == 0:
            store.set(GENERATION_KEY, uuid.uuid4().hex[:16])
        os.environ[GENERATION_ENV] = store.get(GENERATION_KEY).decode()  # inherited by the workers started next

    def _monitor_workers(self, worker_group):
        crashed = self._ended_badly(worker_group)
        if crashed and not set(crashed.values()) <= GRACEFUL_EXIT_CODES:
            self._kill_running()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            own = {r: f for r, f in result.failures.items() if r in crashed}
            self._failures = own or dict(result.failures)
            self.own_failures.clear()
            self.own_failures.update(own)
            final = sorted((r, f.exitcode) for r, f in result.failures.items() if f.exitcode in FINAL_EXIT_CODES)
            if final and self._remaining_restarts > 0:
                rank, code = final[0]
                log(f"execute: no restart: rank {rank} exited with {code} ({FINAL_EXIT_CODES[code]}), which a "
                    "restart would repeat")
                self._remaining_restarts = 0
        return result

    def _restart_workers(self, worker_group) -> None:
        log(self._restart_line(worker_group))
        self._failures = {}
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group) -> None:
        self._shutdown(death_sig=signal.SIGKILL)

    def _handlers(self) -> dict:
        return getattr(self._pcontext, "subprocess_handlers", None) or {}  # torchrun's SubprocessContext

    def _ended_badly(self, worker_group) -> dict[int, int]:
        """{global rank: exit code} of the workers that have ended with a failure (no collective, no wait)."""
        out = {}
        for local_rank, handler in self._handlers().items():
            code = handler.proc.poll()
            if code not in (None, 0):
                out[worker_group.workers[local_rank].global_rank] = code
        return out

    def _kill_running(self) -> None:
        for handler in self._handlers().values():
            if handler.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(handler.proc.pid, signal.SIGKILL)  # its process group: the worker and its children
                with contextlib.suppress(Exception):
                    handler.proc.wait(timeout=10)

    def _restart_line(self, worker_group) -> str:
        spec = worker_group.spec
        step = latest_step(self.run_dir / CHECKPOINTS)
        resume = f"they resume from step-{step}" if step is not None else "no checkpoint yet: they start from step 0"
        failures = getattr(self, "_failures", {})
        ranks = [w.global_rank for w in worker_group.workers]
        span = f"ranks {min(ranks)}-{max(ranks)}" if len(ranks) > 1 else f"rank {ranks[0]}"
        if not failures:
            return (f"execute: restart: a worker on another node failed (or a node joined); restarting this node's "
                    f"{span}; {resume}")
        rank = min(failures)
        more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
        done = spec.max_restarts - self._remaining_restarts
        return (f"execute: restart {done} of {spec.max_restarts}: rank {rank} (this node's local rank "
                f"{failures[rank].local_rank}) {_how(failures[rank])}{more}; restarting {span}; {resume}")


def _how(failure) -> str:
    code = failure.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message or "")
    first = " ".join(message.split()).split(". ")[0][:200]  # its first sentence
    return f"exited with code {code}" + (f": {first}" if first and not first.startswith("To enable") else "")


@contextlib.contextmanager
def meshplan_agent(run_dir: Path):
    """torch.distributed.run.run() inside this block starts a MeshplanAgent for `run_dir`.

    Yields a dict the agent fills with the failures of its last monitored round that ended on their own
    ({global rank: failure}), before it killed their peers: the launcher reports one of those, not a peer
    the agent's SIGKILL ended (torchrun orders failures by their error files' time, which races).
    """
    import torch.distributed.launcher.api as launcher

    own: dict = {}
    agent = type("MeshplanAgentForRun", (MeshplanAgent,), {"run_dir": Path(run_dir), "own_failures": own})
    original = launcher.LocalElasticAgent
    launcher.LocalElasticAgent = agent
    try:
        yield own
    finally:
        launcher.LocalElasticAgent = original
