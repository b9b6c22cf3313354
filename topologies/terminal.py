"""Terminal output shared by every verb.

`--json` prints only JSON on stdout; human tables go to stdout through rich;
progress and logs go to stderr. Kept in the lowest package so every verb module
can use it; rich is imported lazily because `meshplan plan` must start fast.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from topologies.hardware import GIB


def _clean(obj: Any) -> Any:
    """Make an object strict-JSON safe: non-finite floats become null, tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def dumps_json(obj: Any) -> str:
    return json.dumps(_clean(obj), indent=2, allow_nan=False)


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout, nothing else."""
    sys.stdout.write(dumps_json(obj) + "\n")
    sys.stdout.flush()


def console(stderr: bool = False):
    """A rich Console on stdout (results) or stderr (progress and logs)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def log(message: str) -> None:
    """One line of progress on stderr."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def gib(n_bytes: float) -> str:
    """Bytes as GiB with two decimals, for tables."""
    return f"{n_bytes / GIB:.2f} GiB"


class Progress:
    """Progress of one long piece of work on stderr: a live bar on a terminal, nothing otherwise.

    Silent when stderr is not a terminal (CI logs, pipes) or when the verb was
    asked for `--json` (`quiet=True`), so machine-read output never carries
    bar characters. `total=None` shows a spinner with the count done so far.
    Use as a context manager; `advance(n)` moves it, `describe(text)` changes
    the label (e.g. the item being worked on).
    """

    def __init__(self, label: str, total: float | None = None, unit: str = "", quiet: bool = False) -> None:
        self.label, self.total, self.unit = label, total, unit
        self._bar = None
        self._task = None
        self.enabled = not quiet and sys.stderr.isatty()

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
            if self.unit:
                columns.append(TextColumn(self.unit))
            columns += [TimeElapsedColumn(), TimeRemainingColumn()]
            self._bar = RichProgress(*columns, console=console(stderr=True), transient=True)
            self._task = self._bar.add_task(self.label, total=self.total)
            self._bar.start()
        return self

    def advance(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=n)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.label}: {text}")

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
