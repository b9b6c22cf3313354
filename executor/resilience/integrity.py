"""Checksums of checkpoint files: the manifest DCP's writer leaves in every step directory, and its check.

OUT/checkpoints/step-N/checksums.json (written last, by the coordinator, once
every rank's files are on disk; executor.resilience.writer):

  {"format": "meshplan-checksums", "version": 1, "algorithm": "sha256",
   "files": {"__0_0.distcp": {"bytes": 1234, "sha256": "9f2c..."}, ..., ".metadata": {...},
             "run.json": {...}},
   "manifest_sha256": sha256 of the "files" object as canonical JSON}

Each rank hashes the files it wrote, right after writing them (in the
background thread under async_save); the manifest hashes itself, so bytes
flipped inside it name the manifest instead of an innocent file. A
checkpoint written before meshplan recorded checksums has no manifest: it
loads "unverified", as before.

verify_step() checks a share of the files (file i goes to rank i % world, so
N ranks read a checkpoint once, in parallel) for presence, size (a truncated
file is named as such) and sha256. No torch here: `meshplan checkpoint
verify` stays light, and `sha256sum FILE` checks one file by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "checksums.json"
FORMAT = "meshplan-checksums"
VERSION = 1
ALGORITHM = "sha256"


def file_digest(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of one file (hashlib releases the GIL while it reads)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, ALGORITHM).hexdigest()
        size = os.fstat(f.fileno()).st_size
    return {"bytes": size, ALGORITHM: digest}


def _canonical(files: dict) -> bytes:
    return json.dumps(files, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(step_dir: Path, files: dict[str, dict]) -> None:
    """Write step_dir/checksums.json atomically (temporary file, fsync, rename)."""
    doc = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": dict(sorted(files.items())),
           "manifest_sha256": hashlib.sha256(_canonical(files)).hexdigest()}
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


class ManifestError(Exception):
    """checksums.json exists but cannot be trusted (unreadable, not ours, or its own hash fails)."""


def read_manifest(step_dir: Path) -> dict[str, dict] | None:
    """The manifest's files ({name: {"bytes", "sha256"}}), None when the step has no manifest."""
    path = step_dir / MANIFEST
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"{MANIFEST}: unreadable ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise ManifestError(f"{MANIFEST}: not a meshplan checksum manifest")
    if doc.get("version") != VERSION or doc.get("algorithm") != ALGORITHM:
        raise ManifestError(f"{MANIFEST}: version {doc.get('version')!r} / {doc.get('algorithm')!r}; this meshplan "
                            f"reads version {VERSION} / {ALGORITHM}")
    files = doc["files"]
    if hashlib.sha256(_canonical(files)).hexdigest() != doc.get("manifest_sha256"):
        raise ManifestError(f"{MANIFEST}: its own checksum does not match (the manifest is damaged)")
    for name, entry in files.items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int)
                or not isinstance(entry.get(ALGORITHM), str) or "/" in name or name in ("", ".", "..")):
            raise ManifestError(f"{MANIFEST}: malformed entry for {name!r}")
    return files


@dataclass
class Verdict:
    """What verify_step found in its share of one checkpoint."""

    problems: list[str] = field(default_factory=list)  # "FILE: what is wrong", one per damaged file
    files: int = 0  # files checked
    bytes: int = 0  # bytes read
    unverified: bool = False  # no manifest: written before meshplan recorded checksums

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(step_dir: Path, rank: int = 0, world: int = 1) -> Verdict:
    """Check this rank's share of step_dir's files against its manifest (see the module docstring)."""
    verdict = Verdict()
    try:
        files = read_manifest(step_dir)
    except ManifestError as exc:
        verdict.problems.append(str(exc))
        return verdict
    if files is None:
        verdict.unverified = True
        if not (step_dir / ".metadata").is_file():
            verdict.problems.append(".metadata: missing (not a complete checkpoint)")
        return verdict
    for i, name in enumerate(sorted(files)):
        if i % world != rank:
            continue
        problem = _check_file(step_dir / name, files[name])
        verdict.files += 1
        verdict.bytes += files[name]["bytes"]
        if problem:
            verdict.problems.append(f"{name}: {problem}")
    return verdict


def _check_file(path: Path, want: dict) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if size != want["bytes"]:
        how = "truncated" if size < want["bytes"] else "longer than written"
        return f"{size:,} bytes, {want['bytes']:,} written ({how})"
    try:
        got = file_digest(path)[ALGORITHM]
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if got != want[ALGORITHM]:
        return f"contents changed since it was written ({ALGORITHM} {got[:12]}..., written {want[ALGORITHM][:12]}...)"
    return None


def summarize(problems: list[str], limit: int = 3) -> str:
    """The first few problems on one line, with how many more."""
    shown = "; ".join(problems[:limit])
    return shown + (f" (and {len(problems) - limit} more)" if len(problems) > limit else "")


def verify_run(root: Path) -> list[dict]:
    """Every checkpoint under a run's checkpoints/ directory, verified in this process (`checkpoint verify`):
    one {"step", "path", "ok", "unverified", "files", "bytes", "problems"} per step-N, oldest first, and
    one {"step", "path", "set_aside": true} per step-N.damaged directory."""
    from executor.resilience.checkpoints import DAMAGED_SUFFIX, STEP_RE

    out = []
    for path in sorted(root.iterdir(), key=_step_order) if root.is_dir() else []:
        match = STEP_RE.match(path.name)
        if match and path.is_dir():
            verdict = verify_step(path)
            out.append({"step": int(match.group(1)), "path": str(path), "ok": verdict.ok,
                        "unverified": verdict.unverified, "files": verdict.files, "bytes": verdict.bytes,
                        "problems": verdict.problems})
        elif DAMAGED_SUFFIX in path.name and STEP_RE.match(path.name.split(DAMAGED_SUFFIX)[0]):
            out.append({"step": int(path.name.split("-")[1].split(".")[0]), "path": str(path), "set_aside": True})
    return out


def _step_order(path: Path) -> tuple[int, str]:
    head = path.name.split(".")[0]
    return (int(head[5:]), path.name) if head.startswith("step-") and head[5:].isdigit() else (-1, path.name)
