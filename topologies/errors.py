"""Typed errors shared by every layer of meshplan.

They live in `topologies`, the lowest package, so that the planner, the
executor and the CLI can all raise and catch them without an upward import.
Each error carries the process exit code the CLI turns it into (see
ARCHITECTURE.md): 1 runtime failure, 2 usage error, 3 no feasible layout,
4 a run stopped by non-finite losses or gradients, 75 a run preempted after
writing its checkpoint (EX_TEMPFAIL of sysexits.h: try again later, as a
requeued job does), 130 interrupted by Ctrl-C. Messages are written for the
user: what was wrong, with the values, and what to do instead. The CLI prints
them as one line (after `label`), never as a traceback.
"""

from __future__ import annotations


class MeshplanError(Exception):
    """Base class: a failure meshplan understands and can explain."""

    exit_code = 1
    label = "error: "  # what the CLI prints before the message


class UsageError(MeshplanError):
    """Bad input from the user: a flag, a file, a name. Exit code 2."""

    exit_code = 2


class ModelError(UsageError):
    """A model name, preset or config file that cannot be used."""


class TopologyError(UsageError):
    """A cluster preset, override or topology file that cannot be used."""


class PlanError(UsageError):
    """A plan or layout that is malformed or inconsistent."""


class InfeasibleError(MeshplanError):
    """No layout fits: the message states the smallest shortfall. Exit code 3."""

    exit_code = 3


class ExecutionError(MeshplanError):
    """A training run failed at run time. Exit code 1."""

    exit_code = 1


def nearest(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """A ' (did you mean X?)' hint for an unknown name, or '' when nothing is close."""
    import difflib

    lowered = {c.lower(): c for c in choices}
    hit = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    return f" (did you mean {lowered[hit[0]]!r}?)" if hit else ""


class InterruptedRun(MeshplanError):
    """The user pressed Ctrl-C during a run: printed without 'error:', exit 130 as a shell would."""

    exit_code = 130
    label = ""


class NonFiniteError(ExecutionError):
    """A run stopped because its loss or gradient norm stayed non-finite (NaN/inf) for too many steps. Exit 4."""

    exit_code = 4


class PreemptedRun(MeshplanError):
    """SIGTERM (a scheduler's preemption or time limit) stopped the run after its checkpoint: exit 75, no 'error:'."""

    exit_code = 75
    label = ""


class HardwareError(MeshplanError):
    """This machine lacks what a verb needs (no NVIDIA driver, no GPU). Exit code 1."""

    exit_code = 1
