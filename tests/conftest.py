"""Shared test helpers: run the CLI as a subprocess, skip GPU tests without CUDA."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def shared_data(relative: str) -> Path:
    """A file of the project's shared data (`../shared/` beside the checkout).

    CI runs in a fresh clone with shared/ beside it, so there a missing file is
    a failure, never a skip; a developer's checkout without it skips, naming
    the path.
    """
    path = SHARED / relative
    if not path.exists():
        message = f"shared data not found at {path} (../shared/{relative} beside the checkout)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def run_cli(*args: str, timeout: float = 120, cwd: str | Path | None = None, env: dict | None = None,
            preexec_fn=None) -> CliResult:
    """Run `python cli.py ARGS` in a fresh process, as a user's shell would; never leave workers behind.

    `execute` starts torchrun, which starts each worker in its own session, so
    killing the launcher alone on a timeout would orphan them: the launcher gets
    SIGTERM (torchrun's agent then stops its workers), and any process still
    alive whose command line names one of this call's absolute paths is killed.
    """
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, str(REPO / "cli.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd or REPO, env=full_env, preexec_fn=preexec_fn)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        finally:
            proc.kill()
            for pid in processes_mentioning([a for a in args if a.startswith(os.sep)]):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"`meshplan {' '.join(args)}` did not finish in {timeout} s")
    return CliResult(proc.returncode, stdout, stderr)


def invoke_cli(*argv: str, cwd: str | Path | None = None) -> CliResult:
    """`cli.main(ARGV)` in this process (optionally in `cwd`): fast enough to fuzz with.

    Exceptions other than SystemExit propagate: an exception escaping the CLI is
    the traceback a user would see, so the calling test fails on it.
    """
    import cli

    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            else:
                code = 0
    finally:
        os.chdir(previous)
    return CliResult(code, out.getvalue(), err.getvalue())


def processes_mentioning(paths: list[str]) -> list[int]:
    """Live processes (not this one) whose command line contains one of `paths`."""
    found = []
    if not paths:
        return found
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(pid) != os.getpid() and any(path in cmdline for path in paths):
            found.append(int(pid))
    return found


def load_bench(name: str):
    """Import `bench/NAME.py` as a module (the benchmarks are scripts, not a package)."""
    import importlib

    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


@pytest.fixture
def cli():
    return run_cli


TIERS = ("unit", "cli", "multiproc", "gpu", "consumers")  # tests/<tier>/...: the folder is the marker


def pytest_collection_modifyitems(config, items):
    """Mark every test by its folder, and skip the gpu tier when CUDA is absent.

    A test outside the tier folders is an error: its tier would be unknown,
    so `make test-fast` could silently leave it out or run a slow test early.
    """
    for item in items:
        tier = Path(str(item.path)).relative_to(REPO / "tests").parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}/, not {tier!r}")
        item.add_marker(getattr(pytest.mark, tier))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # torch missing: GPU tests cannot run either
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
