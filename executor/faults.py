"""Test-only fault injection: a worker that dies or raises on cue, so the failure paths can be tested.

Every hook is off unless its environment variable is set, and fires only on
the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT unset or 0),
so a restarted worker group runs clean. tests/multiproc/test_failures.py and
test_checkpoint_e2e.py set them; no user-facing flag does.

  MESHPLAN_TEST_KILL_AFTER_STEP="STEP:RANK"        rank RANK SIGKILLs itself after
                                                    logging step STEP (executor.train)
  MESHPLAN_TEST_CRASH_IN_SAVE="STEP[:RANK[:raise]]" rank RANK (default 0) SIGKILLs
                                                    itself, or raises, between dcp.save
                                                    of step STEP and the rename that
                                                    publishes it (executor.components.checkpoint)
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "MESHPLAN_TEST_KILL_AFTER_STEP"
CRASH_ENV = "MESHPLAN_TEST_CRASH_IN_SAVE"


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def kill_after_step(step: int, rank: int) -> None:
    """SIGKILL this rank after `step` when KILL_ENV names it."""
    spec = os.environ.get(KILL_ENV)
    if not spec or not _first_attempt():
        return
    kill_step, kill_rank = (int(x) for x in spec.split(":"))
    if step == kill_step and rank == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)


def crash_in_save(step: int, rank: int) -> None:
    """Die (or raise) between writing checkpoint `step` and publishing it, when CRASH_ENV names this rank."""
    spec = os.environ.get(CRASH_ENV)
    if not spec or not _first_attempt():
        return
    fields = spec.split(":")  # STEP[:RANK[:raise]]
    if int(fields[0]) != step or int(fields[1] if len(fields) > 1 else 0) != rank:
        return
    if fields[2:] == ["raise"]:
        raise RuntimeError(f"{CRASH_ENV}: rank {rank} raises after writing step {step}")
    os.kill(os.getpid(), signal.SIGKILL)
