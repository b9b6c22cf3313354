"""Ctrl-C and preemption in a worker: flags set by signal handlers, read by the training loop at step boundaries.

torchrun starts workers in their own sessions, so a terminal's Ctrl-C reaches
only the agent, which forwards SIGINT to every worker; a scheduler's SIGTERM
(SLURM's time limit or preemption, a cloud's spot notice) reaches the agent,
the workers, or both, and the agent forwards it too. The handlers are
installed before the worker's heavy imports (torch takes seconds), so even an
early signal is a request to stop, never a KeyboardInterrupt traceback or a
death without a checkpoint. The ranks agree on the stop in
executor.resilience.keeper (one all-reduce per step, the strongest request
wins): SIGINT stops after the current step (exit INTERRUPTED_EXIT_CODE),
SIGTERM also writes a checkpoint of that step first (exit
PREEMPTED_EXIT_CODE, which the SLURM script requeues on). No torch here.
"""

from __future__ import annotations

import signal
import time

from topologies.errors import InterruptedRun, PreemptedRun

INTERRUPTED_EXIT_CODE = InterruptedRun.exit_code  # 130: the shell's code for a process ended by SIGINT
PREEMPTED_EXIT_CODE = PreemptedRun.exit_code  # 75: EX_TEMPFAIL, try again later (resume)
NONE, INTERRUPT, PREEMPT = 0, 1, 2  # stop requests, weakest first
STOP_REQUESTED = {"flag": False, "kind": NONE, "since": None}


def request_stop(signum, frame) -> None:
    kind = PREEMPT if signum == signal.SIGTERM else INTERRUPT
    if kind > STOP_REQUESTED["kind"]:
        STOP_REQUESTED.update(flag=True, kind=kind, since=time.monotonic())


def install() -> None:
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
