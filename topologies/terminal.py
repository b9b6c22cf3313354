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


def si(value: float) -> str:
    """1234567 -> '1.23M': 3 significant digits and a k/M/B/T suffix, for narrow tables and chart labels."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{unit}"
    return f"{value:.3g}"


def gib(n_bytes: float) -> str:
    """Bytes as GiB with two decimals, for tables."""
    return f"{n_bytes / GIB:.2f} GiB"


class Progress:
    """Progress of one long piece of work on stderr: a live bar on a terminal, nothing otherwise.

    Silent when stderr is not a terminal (CI logs, pipes) or when the verb was
    asked for `--json` (`quiet=True`), so machine-read output never carries
    bar characters. `total=None` shows a spinner with the count done so far.
    Use as a context manager; `advance(n)` moves it, `describe(text)` changes
    the label (e.g. the item being worked on), `update(completed=, total=)`
    sets either outright (a total learnt once the work starts), `phase(label,
    total)` starts the next piece of work on a line of its own. The bar is
    transient: it leaves nothing behind on the terminal once the work is done.
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

            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total is not None or self.unit:  # something counted: a bar, the count and the time left
                columns += [BarColumn(), MofNCompleteColumn(), *([TextColumn(self.unit)] if self.unit else []),
                            TimeElapsedColumn(), TimeRemainingColumn()]
            else:  # one piece of work: a spinner and the time it has taken
                columns.append(TimeElapsedColumn())
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

    def update(self, completed: float | None = None, total: float | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, total=total)

    def phase(self, label: str, total: float | None = None) -> None:
        """The next piece of work (collectives after kernels): a new line; the previous one stays as it stands."""
        self.label, self.total = label, total
        if self._bar is not None:
            self._task = self._bar.add_task(label, total=total)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
