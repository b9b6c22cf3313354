"""Test-only fault injection: a worker that dies, hangs, pauses, raises or sees NaN on cue.

Every hook is off unless its environment variable is set, and fires only in a
worker's first life: not after a torchrun restart (TORCHELASTIC_RESTART_COUNT
> 0) and not once the process has resumed a checkpoint (`disarm`, called by
the checkpoint loader; a healthy node's restarted workers keep restart count
0, but they resume). tests/multiproc set them; no user-facing flag does.

  MESHPLAN_TEST_KILL_AFTER_STEP="STEP:RANK"        rank RANK SIGKILLs itself after logging step STEP
  MESHPLAN_TEST_STOP_AFTER_STEP="STEP:RANK"        rank RANK SIGSTOPs itself after step STEP (a rank hung
                                                    in a collective, as far as its peers can tell)
  MESHPLAN_TEST_KILL_NODE_AFTER_STEP="STEP"        every worker of the `execute` given it SIGKILLs its
                                                    torchrun agent and itself after step STEP: a lost node
  MESHPLAN_TEST_PAUSE_AFTER_STEP="STEP:SECONDS"    every rank sleeps after step STEP (until a stop is
                                                    requested), so a test can signal a run mid-way
  MESHPLAN_TEST_NAN_LOSS="STEP[,STEP...]"          those steps' loss and gradients become NaN
  MESHPLAN_TEST_CRASH_IN_SAVE="STEP[:RANK[:raise]]" rank RANK (default 0) SIGKILLs itself, or raises,
                                                    between DCP's write of step STEP and the rename that
                                                    publishes it (executor.components.checkpoint)
"""

from __future__ import annotations

import os
import signal
import time

KILL_ENV = "MESHPLAN_TEST_KILL_AFTER_STEP"
STOP_ENV = "MESHPLAN_TEST_STOP_AFTER_STEP"
KILL_NODE_ENV = "MESHPLAN_TEST_KILL_NODE_AFTER_STEP"
PAUSE_ENV = "MESHPLAN_TEST_PAUSE_AFTER_STEP"
NAN_ENV = "MESHPLAN_TEST_NAN_LOSS"
CRASH_ENV = "MESHPLAN_TEST_CRASH_IN_SAVE"
ALL = (KILL_ENV, STOP_ENV, KILL_NODE_ENV, PAUSE_ENV, NAN_ENV, CRASH_ENV)


def disarm() -> None:
    """Turn every hook off in this process (called once a checkpoint is resumed)."""
    for name in ALL:
        os.environ.pop(name, None)


def _spec(name: str) -> list[str] | None:
    spec = os.environ.get(name)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return spec.split(":")


def after_step(step: int, rank: int, stop_requested=lambda: False) -> None:
    """The hooks that act after step `step` was logged (and checkpointed, if one was due)."""
    for name, sig in ((KILL_ENV, signal.SIGKILL), (STOP_ENV, signal.SIGSTOP)):
        fields = _spec(name)
        if fields and int(fields[0]) == step and int(fields[1]) == rank:
            os.kill(os.getpid(), sig)
    fields = _spec(KILL_NODE_ENV)
    if fields and int(fields[0]) == step:
        os.kill(os.getppid(), signal.SIGKILL)  # the agent first, so it cannot restart this node's workers
        os.kill(os.getpid(), signal.SIGKILL)
    fields = _spec(PAUSE_ENV)
    if fields and int(fields[0]) == step:
        deadline = time.monotonic() + float(fields[1])
        while time.monotonic() < deadline and not stop_requested():
            time.sleep(0.05)


def poison(step: int, loss, params) -> object:
    """NaN loss and gradients at the steps NAN_ENV names (the first parameter's gradient on every rank)."""
    fields = _spec(NAN_ENV)
    if not fields or str(step) not in fields[0].split(","):
        return loss
    for p in params:
        if p.grad is not None:
            p.grad.fill_(float("nan"))
            break
    return loss * float("nan") if loss is not None else None


def crash_in_save(step: int, rank: int) -> None:
    """Die (or raise) between writing checkpoint `step` and publishing it, when CRASH_ENV names this rank."""
    fields = _spec(CRASH_ENV)  # STEP[:RANK[:raise]]
    if not fields or int(fields[0]) != step or int(fields[1] if len(fields) > 1 else 0) != rank:
        return
    if fields[2:] == ["raise"]:
        raise RuntimeError(f"{CRASH_ENV}: rank {rank} raises after writing step {step}")
    os.kill(os.getpid(), signal.SIGKILL)
