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
