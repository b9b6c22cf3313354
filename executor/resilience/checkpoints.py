"""The checkpoint directory of a run, as files: step directories, the `latest` pointer, what a resume tries.

OUT/checkpoints/step-N/ (complete: it holds .metadata), OUT/checkpoints/latest
(one line, "step-N"), OUT/checkpoints/.tmp-* (saves in progress or cut
short), OUT/checkpoints/step-N.damaged/ (a checkpoint that failed
verification, set aside: kept for inspection, never loaded or pruned).

A resume tries the checkpoint `latest` names (the newest complete one when
the pointer is missing or stale), then the older complete ones, newest first;
never one newer than the pointer (after `--resume-from step-K` the newer
steps belong to an abandoned continuation until this run writes its own).
No torch here: `meshplan checkpoint verify` and the launcher's checks use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from topologies.errors import UsageError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d+)$")
DAMAGED_SUFFIX = ".damaged"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under root (a step-N directory holding .metadata)."""
    found = [int(m.group(1)) for p in root.iterdir() if (m := STEP_RE.match(p.name))] if root.is_dir() else []
    return sorted(s for s in found if (root / f"step-{s}" / ".metadata").is_file())


def pointer_step(root: Path) -> int | None:
    """The step root/latest names, if it names one (complete or not)."""
    try:
        match = STEP_RE.match((root / LATEST).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    return int(match.group(1)) if match else None


def latest_step(root: Path, log=None) -> int | None:
    """The step root/latest names, or the newest complete one when the pointer is missing or stale."""
    complete = complete_steps(root)
    named = pointer_step(root)
    if named is not None and named in complete:
        return named
    if complete and log is not None:
        log(f"checkpoint: pointer {root / LATEST} missing or stale; using step-{complete[-1]}")
    return complete[-1] if complete else None


def candidates(root: Path, log=None) -> list[int]:
    """What a resume tries, in order (see the module docstring)."""
    first = latest_step(root, log)
    if first is None:
        return []
    return [first] + [s for s in reversed(complete_steps(root)) if s < first]


def parse_step(text: str) -> int:
    """--resume-from's value: "step-K" (or K) -> K."""
    match = STEP_RE.match(text.strip()) or re.fullmatch(r"(\d+)", text.strip())
    if not match:
        raise UsageError(f"--resume-from {text!r}: name a checkpoint as step-K (a directory under OUT/{CHECKPOINTS}/)")
    return int(match.group(1))


def point_latest(root: Path, step: int) -> None:
    """Make `latest` name step-N: temporary file, fsync, rename, fsync of the directory."""
    pointer = root / f".tmp-{LATEST}"
    with open(pointer, "w") as f:
        f.write(f"step-{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    fsync_dir(root)


def set_aside(root: Path, step: int) -> Path:
    """Rename a damaged step-N to step-N.damaged (or .damaged-2, ...): kept, but out of every listing."""
    source = root / f"step-{step}"
    target = root / f"step-{step}{DAMAGED_SUFFIX}"
    n = 1
    while target.exists():
        n += 1
        target = root / f"step-{step}{DAMAGED_SUFFIX}-{n}"
    source.rename(target)
    fsync_dir(root)
    return target


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
