"""The host-sync counter of tests/host_syncs.py counts what it says, where it says, once per read."""

from __future__ import annotations

import torch
from host_syncs import READS, HostSyncCounter, StepWindows

from executor.resilience.agree import refuse_non_finite


def _one_read(t: torch.Tensor) -> None:
    """executor code that reads one value back: the finite check of a state (one .item())."""
    refuse_non_finite({"model": {"w": t}}, step=1)


def test_reads_in_the_repository_are_counted_by_site_and_library_reads_apart():
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    with HostSyncCounter() as counter:
        _one_read(torch.ones(3))  # one .item() in executor code
        t = torch.tensor(1.5)
        text = f"{t:.2f}"  # __format__ calls .item() inside: one read, not two
        assert float(t) == 1.5 and text == "1.50"
        torch.zeros(2, device="meta").sum()  # meta tensors hold no data: never a read
    assert dict(counter.own) == {"executor/resilience/agree.py refuse_non_finite .item()": 1}
    assert sum(counter.library.values()) == 2  # this test's own format() and float(): not the repository's
    assert {name: getattr(torch.Tensor, name) for name in READS} == originals  # restored on exit


def test_step_windows_hold_the_reads_between_step_starts():
    t = torch.tensor(1.0)
    with HostSyncCounter() as counter:
        windows = StepWindows(counter)
        for step in (1, 2):
            windows.begin(step)
            for _ in range(step):
                _one_read(t)
        windows.close()
    assert [(row["step"], sum(row["own"].values())) for row in windows.steps] == [(1, 1), (2, 2)]
