"""One run per directory: OUT/run.lock, held by node 0's `meshplan execute` for the whole run.

Two `execute` commands into one --out would both pass the "already holds a
run" check before either writes, then interleave metrics.jsonl and race on
checkpoints/latest. The lock is taken before that check and before any rank
starts, and released when the command ends (restarts included).

Mechanism: an exclusive `flock` on OUT/run.lock (released by the kernel when
the holder dies, so a crash never leaves the directory locked), and in the
file the holder's host, pid, start time and command line, so a refusal can
name who holds it. A file whose lock is free but whose text names a holder is
stale (that process ended without cleaning up): it is taken over with a line
saying whose it was. Where flock is not supported (some network mounts), the
text alone decides: a live pid on this host holds the lock, a dead one is
stale, and another host's is refused with the path to delete once that run
is known to be gone.

On release the file is unlinked while still locked; an acquirer checks that
the file it locked is still the one at the path (same inode), or retries, so
a waiter that opened the old file cannot think it holds the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from topologies.errors import UsageError

LOCK_NAME = "run.lock"


@dataclass
class RunLock:
    """A held lock; `release()` (or the context manager's exit) gives it back."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                if _same_file(self.fd, self.path):
                    os.unlink(self.path)
        finally:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(out: Path, log=None) -> RunLock:
    """Lock run directory `out` (created if missing) for this process, or raise UsageError naming the holder."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the run directory {str(out)!r}: {exc.strerror}; pass a writable --out") from None
    path = out / LOCK_NAME
    for _ in range(10):  # another process may unlink the file between our open and our flock: retry
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(f"cannot create the lock file {str(path)!r}: {exc.strerror}; pass a writable --out") \
                from None
        try:
            locked = _flock(fd)
        except BaseException:
            os.close(fd)
            raise
        if locked is False:
            holder = _read(path)
            os.close(fd)
            raise UsageError(f"--out {str(out)!r} is in use by another run ({describe(holder)}); wait for it to "
                             f"finish, stop it, or pass another --out")
        if not _same_file(fd, path):
            os.close(fd)
            continue
        previous = _read_fd(fd)
        if locked is None:  # no flock here: the holder's text decides
            _check_by_pid(previous, path, fd)
        if previous and log is not None:
            log(f"execute: took over the stale lock {path} of a run that is no longer running ({describe(previous)})")
        _write(fd, _me())
        return RunLock(path, fd)
    raise UsageError(f"cannot lock {str(path)!r}: it keeps being replaced by other processes; is another run "
                     "starting into the same --out?")


def holder(out: Path) -> dict | None:
    """The holder recorded in OUT/run.lock, or None when there is no lock file (or it is empty)."""
    return _read(out / LOCK_NAME) or None


def describe(info: dict | None) -> str:
    """'pid 123 on host h since 2026-11-29 05:40:01 (meshplan execute ...)' for a refusal or a takeover line."""
    if not info:
        return "holder unknown: the lock file is empty or unreadable"
    text = f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"
    if info.get("started"):
        text += f" since {info['started']}"
    if info.get("command"):
        text += f": {info['command']}"
    return text


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return None
        raise


def _check_by_pid(previous: dict, path: Path, fd: int) -> None:
    """Without flock: refuse a holder that is alive here or lives on another host."""
    if not previous:
        return
    if previous.get("host") != socket.gethostname():
        os.close(fd)
        raise UsageError(f"{str(path)!r} names a run on another host ({describe(previous)}) and this file system "
                         "cannot lock files; if that run has ended, delete the lock file and run again")
    pid = previous.get("pid")
    if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
        os.close(fd)
        raise UsageError(f"--out {str(path.parent)!r} is in use by another run ({describe(previous)}); wait for it "
                         "to finish, stop it, or pass another --out")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
            "command": " ".join(["meshplan", *sys.argv[1:]])[:300]}


def _write(fd: int, info: dict) -> None:
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_fd(fd: int) -> dict:
    try:
        size = os.fstat(fd).st_size
        return _parse(os.pread(fd, min(size, 65536), 0))
    except OSError:
        return {}


def _read(path: Path) -> dict:
    try:
        return _parse(path.read_bytes()[:65536])
    except OSError:
        return {}


def _parse(data: bytes) -> dict:
    try:
        info = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {"command": "unreadable lock file"} if data.strip() else {}
    return info if isinstance(info, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

