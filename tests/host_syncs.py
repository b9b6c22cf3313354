"""Counting device-to-host syncs per training step, on CPU ranks and on GPUs.

A GPU runs kernels asynchronously: the host queues a step's work and moves
on, unless it reads a value off the device (`.item()`, `.tolist()`,
`.cpu()`, `float(t)`, `if t:` ...), which waits for every kernel queued so
far. One such read per step stalls the host once a step; on CPU ranks every
kernel is synchronous already, so timings there cannot show the cost, and
the syncs must be counted instead.

- CPU (`HostSyncCounter`): the Python entry points of a device read on
  torch.Tensor are wrapped (READS); a call counts when the frame calling it
  is the repository's own code (executor/, planner/, topologies/), keyed by
  file, function and method, without line numbers so edits elsewhere in a
  file keep the keys. Reads made inside torch (AdamW reading its CPU step
  counter, for one) cannot be told apart from device reads on CPU ranks, so
  they are listed under `library` and not asserted; `.to("cpu")` is not
  wrapped, since on CPU ranks every `.to(device)` is one. A read nested in
  another (`f"{t:.3f}"` calls `.item()`) counts once, as the outer call.
- CUDA (`CudaSyncCounter`): torch.cuda.set_sync_debug_mode("warn") makes
  torch warn at every synchronizing operation, its own included; the
  warnings are counted.

`tests/host_sync_worker.py` runs a real `executor.worker` under torchrun with
a counter installed and records, per rank, the reads between the starts of
consecutive optimizer steps (the stop check and the metrics line between
steps included).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
OWN_DIRS = tuple(str(REPO / name) + "/" for name in ("executor", "planner", "topologies"))
# torch.Tensor entry points that read a device value into host memory
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")


class HostSyncCounter:
    """Wraps READS on torch.Tensor while active; `own` and `library` count reads by site (module docstring)."""

    def __init__(self) -> None:
        self.own: Counter[str] = Counter()
        self.library: Counter[str] = Counter()
        self._saved: dict[str, object] = {}
        self._depth = threading.local()

    def __enter__(self) -> HostSyncCounter:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original):
        counter = self
        method = f".{name}()" if not name.startswith("__") else f"{name.strip('_')}()"

        def read(tensor, *args, **kwargs):
            depth = getattr(counter._depth, "n", 0)
            if depth == 0 and not tensor.is_meta:
                counter._record(sys._getframe(1), method)
            counter._depth.n = depth + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._depth.n = depth

        read.__name__ = name
        return read

    def _record(self, frame, method: str) -> None:
        path = frame.f_code.co_filename
        own = path.startswith(OWN_DIRS)
        where = str(Path(path).relative_to(REPO)) if own else _library_path(path)
        (self.own if own else self.library)[f"{where} {frame.f_code.co_name} {method}"] += 1

    def snapshot(self) -> tuple[Counter, Counter]:
        return Counter(self.own), Counter(self.library)


class CudaSyncCounter:
    """torch.cuda.set_sync_debug_mode("warn") while active; every synchronizing operation is one warning."""

    def __init__(self) -> None:
        self.own: Counter[str] = Counter()
        self.library: Counter[str] = Counter()
        self._catch = warnings.catch_warnings(record=True)
        self._records: list = []

    def __enter__(self) -> CudaSyncCounter:
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)

    def snapshot(self) -> tuple[Counter, Counter]:
        """Synchronizing operations so far, by the line that issued them (all under `own`: CUDA sees every one)."""
        for record in self._records:
            if "synchronizing" in str(record.message).lower():
                path = str(record.filename)
                where = str(Path(path).relative_to(REPO)) if path.startswith(OWN_DIRS) else _library_path(path)
                self.own[f"{where}:{record.lineno}"] += 1
        self._records.clear()
        return Counter(self.own), Counter(self.library)


def _library_path(path: str) -> str:
    """'torch/optim/adamw.py' for a file inside an installed package, else the file name."""
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return Path(path).name


class StepWindows:
    """Per-step counts: the reads between the starts of consecutive optimizer steps, and after the last."""

    def __init__(self, counter) -> None:
        self.counter = counter
        self.steps: list[dict] = []
        self._open: tuple[int, Counter, Counter] | None = None

    def begin(self, step: int) -> None:
        self.close()
        own, library = self.counter.snapshot()
        self._open = (step, own, library)

    def close(self) -> None:
        if self._open is None:
            return
        step, own0, library0 = self._open
        own, library = self.counter.snapshot()
        self.steps.append({"step": step, "own": dict(own - own0), "library": dict(library - library0)})
        self._open = None


def syncs_per_step(report: dict) -> dict[int, int]:
    """{step: reads made by the repository's code} from one rank's report."""
    return {row["step"]: sum(row["own"].values()) for row in report["steps"]}
