"""Ctrl-C in a worker: a flag set by the SIGINT handler, read by the training loop at step boundaries.

torchrun starts workers in their own sessions, so a terminal's Ctrl-C reaches
only the agent, which forwards SIGINT to every worker. The handler is
installed before the worker's heavy imports (torch takes seconds), so even an
early Ctrl-C is a request to stop, never a KeyboardInterrupt traceback. The
ranks agree on the stop in executor.train (one all-reduce per step), write
the summary, and exit with INTERRUPTED_EXIT_CODE. No torch here.
"""

from __future__ import annotations

import signal

INTERRUPTED_EXIT_CODE = 130  # the shell's code for a process ended by SIGINT
STOP_REQUESTED = {"flag": False}


def request_stop(signum, frame) -> None:
    STOP_REQUESTED["flag"] = True


def install() -> None:
    signal.signal(signal.SIGINT, request_stop)
