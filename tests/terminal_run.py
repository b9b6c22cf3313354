"""Run a verb as a person at a terminal would: stderr on a pseudo-terminal, stdout a pipe.

Progress bars draw only where stderr is a terminal (topologies.terminal.Progress),
so the tests that check them need one; `pty` gives a real one, sized 120 x 40.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import tempfile
import termios
import time

from conftest import REPO, CliResult

# rich reads these (rich.console.Console); a runner's FORCE_COLOR or NO_COLOR must not decide what the test sees
_RICH_ENV = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES", "COLORTERM")


def run_on_terminal(*args: str, timeout: float = 120) -> CliResult:
    """`python cli.py ARGS` with stderr on a pseudo-terminal; CliResult.stderr is everything drawn on it."""
    env = {k: v for k, v in os.environ.items() if k not in _RICH_ENV}
    env.update(TERM="xterm-256color", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "cli.py"), *args], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=slave, cwd=REPO, env=env)
        os.close(slave)
        drawn = bytearray()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.5)
                if ready:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:  # EIO: the child closed its end
                        break
                    if not chunk:
                        break
                    drawn += chunk
                elif proc.poll() is not None:
                    break
            else:
                proc.kill()
                raise AssertionError(f"`meshplan {' '.join(args)}` did not finish in {timeout} s")
            proc.wait(timeout=30)
        finally:
            os.close(master)
        out.seek(0)
        return CliResult(proc.returncode, out.read().decode(), drawn.decode(errors="replace"))
