"""Which checkpoint a resume loads: the newest that verifies, and what happens to the ones that do not.

The candidates are executor.resilience.checkpoints' (the one `latest` names,
then older complete ones, newest first), or exactly --resume-from's. Each is
verified against its checksums, every rank reading its share of the files
(executor.resilience.integrity), then loaded by the caller's `try_load`
(DCP, collective). One that fails verification is named file by file, set
aside as step-N.damaged and the next older one tried (one asked for by name is
refused instead); one that verifies but that DCP cannot load (another model?)
is skipped and kept. `latest` is then moved to the checkpoint that loaded, so
it never names one that failed. A checkpoint without checksums (older
meshplan) loads unverified. Every rank takes every decision from gathered or
broadcast values, so all load the same step or raise the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from executor.resilience import checkpoints as dirs
from executor.resilience.agree import all_gather, barrier, broadcast, rank, world
from executor.resilience.integrity import summarize, verify_step
from topologies.errors import UsageError
from topologies.terminal import log


def load_newest_valid(root: Path, try_load: Callable[[Path], str | None], step: int | None = None,
                      say_none: bool = True) -> int:
    """The step loaded (0: none to load); UsageError when checkpoints exist but none loads."""
    order = broadcast(_candidates(root, step) if rank() == 0 else None)
    tried: list[str] = []
    damaged = 0
    for i, s in enumerate(order):
        path = root / f"step-{s}"
        problems, unverified = _verify(path)
        if problems:
            tried.append(f"step-{s}: {summarize(problems)}")
            damaged += 1
            if step is not None:
                raise UsageError(f"--resume-from step-{s}: {path} fails verification: {summarize(problems)}; "
                                 f"`meshplan checkpoint verify {root.parent}` lists the valid checkpoints")
            _set_aside(root, s, problems, order[i + 1] if i + 1 < len(order) else None)
            continue
        reason = try_load(path)
        if reason is not None:
            tried.append(f"step-{s}: {reason}")
            if rank() == 0:
                log(f"checkpoint: cannot load {path}: {reason}")
            continue
        if rank() == 0:
            _loaded(root, s, unverified)
        return s
    if tried and damaged == len(tried):
        raise UsageError(f"cannot resume from {str(root)!r}: every checkpoint there fails verification "
                         f"({'; '.join(tried)}), and is set aside as step-N.damaged: restore the files, or start "
                         "over with --overwrite")
    if tried:
        raise UsageError(f"cannot resume from {str(root)!r}: no checkpoint there loads ({'; '.join(tried)}); "
                         "a checkpoint of another model? resume with the plan that wrote it, pick one with "
                         "--resume-from step-K, or start over with --overwrite")
    if rank() == 0 and say_none:
        log(f"checkpoint: none under {str(root)!r}; starting from step 0")
    return 0


def _candidates(root: Path, step: int | None) -> list[int]:
    if step is None:
        return dirs.candidates(root, log)
    complete = dirs.complete_steps(root)
    if step not in complete:
        have = ", ".join(f"step-{s}" for s in complete) or "none"
        raise UsageError(f"--resume-from step-{step}: no complete checkpoint {root / f'step-{step}'} "
                         f"(complete ones: {have})")
    return [step]


def _verify(path: Path) -> tuple[list[str], bool]:
    """Every rank checks its share of path's files; all learn every problem (sorted) and whether it is
    unverified (no checksums)."""
    verdict = verify_step(path, rank(), world())
    found = all_gather((verdict.problems, verdict.unverified))
    return sorted({p for problems, _ in found for p in problems}), any(u for _, u in found)


def _set_aside(root: Path, step: int, problems: list[str], fallback: int | None) -> None:
    if rank() == 0:
        try:
            where = f"set aside as {dirs.set_aside(root, step).name}"
        except OSError as exc:
            where = f"could not be set aside ({exc.strerror})"
        then = f"falling back to step-{fallback}" if fallback is not None else "no older checkpoint to fall back to"
        log(f"checkpoint: step-{step} fails verification ({summarize(problems)}); {where}; {then}")
    barrier()


def _loaded(root: Path, step: int, unverified: bool) -> None:
    note = " (no checksums: written before meshplan recorded them)" if unverified else ""
    log(f"checkpoint: resumed from {root / f'step-{step}'}{note}")
    if dirs.pointer_step(root) != step:
        dirs.point_latest(root, step)
        log(f"checkpoint: {root / dirs.LATEST} now names step-{step}")
