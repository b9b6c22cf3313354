"""What run a checkpoint belongs to, and which changes a resume may make.

Every checkpoint holds run.json (written by rank 0 into the step directory
before DCP's files, covered by its checksums): the model, sequence length,
global batch, --steps and layout of the run that wrote it.

A resume may change the layout (the checkpoint is keyed by parameter names
and resharded on load: tested FSDP -> TP x DP, PP x DP -> FSDP, 4 -> 2 ranks).
It may not silently change what is trained: another sequence length or global
batch changes what one step is, and the LR schedule is restored from the
checkpoint, so a longer --steps would run its extra steps at the floor rate.
Such a resume is refused before any rank starts, naming each change, unless
--allow-plan-change; then the LR schedule is rebuilt for the new --steps from
the step resumed (executor.components.optim.WarmupCosine.rescheduled) and the
run says so. The data position is kept in sequences.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from topologies.errors import UsageError

RUN_INFO = "run.json"
CHECKED = (("model", "model"), ("seq_len", "sequence length"), ("global_batch_size", "global batch"),
           ("steps", "--steps"))


def run_info(plan, steps: int) -> dict:
    """The run.json of a checkpoint written by this run."""
    lay = plan.layout
    return {"model": plan.model.name, "seq_len": plan.training.seq_len,
            "global_batch_size": plan.training.global_batch_size, "steps": steps, "world_size": plan.world_size,
            "layout": {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp,
                       "tp": lay.tp, "zero_stage": lay.zero_stage}}


def write_run_info(step_dir: Path, info: dict, step: int) -> None:
    """Write step_dir/run.json (the step included), flushed to disk before the checkpoint's files."""
    with open(step_dir / RUN_INFO, "w") as f:
        json.dump({**info, "step": step}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_run_info(step_dir: Path) -> dict | None:
    """A checkpoint's run.json; None when it has none (written before meshplan recorded it) or it is unreadable
    (verification names the damage)."""
    try:
        info = json.loads((step_dir / RUN_INFO).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def changes(saved: dict, current: dict) -> list[str]:
    """'sequence length 64 -> 128', one per checked value that differs."""
    return [f"{label} {saved[key]} -> {current[key]}" for key, label in CHECKED
            if key in saved and saved[key] != current.get(key)]


def check_resume(step_dir: Path, current: dict, allow: bool) -> str | None:
    """Refuse (UsageError) a resume from step_dir that changes the run, unless `allow`; then return the line
    saying what changes. None when nothing changes (or the checkpoint predates run.json)."""
    saved = read_run_info(step_dir)
    if saved is None:
        return None
    found = changes(saved, current)
    if not found:
        return None
    what = ", ".join(found)
    if not allow:
        raise UsageError(
            f"--resume: {step_dir.name} was written by a run of another shape ({what}); resume with the same plan "
            f"and --steps {saved.get('steps')}, or pass --allow-plan-change to continue with the new values (the "
            "LR schedule is then rebuilt for the new --steps from the step resumed)")
    return (f"execute: --allow-plan-change: resuming {step_dir.name} with {what}"
            + ("; the LR schedule is rebuilt for the new --steps from there" if saved.get("steps") != current.get("steps")
               else ""))
