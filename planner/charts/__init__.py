"""The pictures meshplan draws, each built from a plain data object that tests inspect, then drawn.

  timeline.py   one step, folded: `simulate --png`
  memory.py     memory per GPU by category: per pipeline stage and per ranked layout, `plan --png`
  scaling.py    tokens/s, days and cost against the GPU count: `plan --gpus auto --png`
  (the comparison chart is `planner.search.compare.plot_compare`; a run's report
  `executor.validate.report_chart`)

Each module has a `*_chart(...)` that gathers the figures into a frozen
dataclass, a `draw_*` that turns it into a matplotlib Figure (axis labels, marks
and text come from the data object, so tests read both), and a `plot_*` that
saves it. matplotlib is imported inside the drawing functions (Agg backend, no
display): the planning path does not pay for it unless a chart is asked for.

A chart is written once, at a path the user chose, through
`topologies.files.save_figure`: the format comes from the suffix (checked up
front by `check_output(..., image=True)`), a regular file is replaced
atomically, a device or `-` is written in place, and the figure is always
closed so a long `compare` over many variants does not pile up matplotlib state.
"""

from __future__ import annotations

from topologies.files import save_figure
from topologies.terminal import si

__all__ = ["pyplot", "save_figure", "si"]


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
