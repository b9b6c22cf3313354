"""topologies.terminal.Progress: a bar only where a person watches stderr, never under --json or in a pipe."""

from __future__ import annotations

import io
import sys

from topologies.terminal import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_in_a_pipe_and_under_json(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with Progress("tokenize", total=4) as bar:
        bar.advance(4)
    assert not bar.enabled and sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", _Tty())
    with Progress("tokenize", total=4, quiet=True) as bar:
        bar.advance(4)
    assert not bar.enabled and sys.stderr.getvalue() == ""


def test_counts_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Tty())
    with Progress("search", total=5, unit="shapes") as bar:
        assert bar.enabled
        bar.advance(2)
        bar.describe("tp 2")
        bar.advance(3)
        task = bar._bar.tasks[0]
        assert (task.completed, task.total, task.description) == (5, 5, "search: tp 2")
    assert bar._bar is None  # stopped on exit


def test_totals_learnt_late_and_phases(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Tty())
    with Progress("calibrate", total=3, unit="measured") as bar:
        bar.update(completed=3)
        bar.phase("collectives")
        bar.update(completed=1, total=4)
        first, second = bar._bar.tasks
        assert (first.completed, first.total, first.description) == (3, 3, "calibrate")
        assert (second.completed, second.total, second.description) == (1, 4, "collectives")
        bar.describe("all_gather")
        assert second.description == "collectives: all_gather"
    with Progress("dry run: importing torch") as spinner:  # nothing counted: no bar, no "0/?"
        columns = [type(c).__name__ for c in spinner._bar.columns]
    assert "BarColumn" not in columns and "MofNCompleteColumn" not in columns
