"""Shared ending of every chart meshplan draws (memory, comparison, step timeline).

A chart is written once, at a path the user chose, through
`topologies.files.save_figure`: the format comes from the suffix (checked up
front by `check_output(..., image=True)`), a regular file is replaced
atomically, a device or `-` is written in place, and the figure is always
closed so a long `compare` over many variants does not pile up matplotlib state.
"""

from __future__ import annotations

from topologies.files import save_figure

__all__ = ["save_figure"]
