"""`--png`: one stacked bar per layout, memory per GPU by category.

matplotlib is imported inside `plot_memory` (Agg backend, no display) so the
planning path does not pay for it unless a chart is asked for.
"""

from __future__ import annotations

from pathlib import Path

from planner.charts import save_figure
from planner.plan import MEMORY_CATEGORIES
from topologies.errors import UsageError
from topologies.hardware import GIB

# One colour per category, in MEMORY_CATEGORIES order (matplotlib's tab10).
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#7f7f7f")


def plot_memory(entries: list[tuple[str, dict[str, int]]], path: str | Path,
                capacity_bytes: int | None = None, title: str = "Memory per GPU (worst rank)",
                limit_bytes: int | None = None) -> None:
    """Draw a stacked bar in GiB for each (label, breakdown_bytes) and save it as a PNG.

    capacity_bytes, when given, draws the GPU's memory as a dashed line so a
    bar above it reads as "does not fit"; limit_bytes draws the planning limit
    (the GPU's memory less --memory-headroom), the line the search keeps under.
    """
    if not entries:
        raise UsageError("plot_memory needs at least one layout to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in entries]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(entries) + 2.5), 4.5))
    bottoms = [0.0] * len(entries)
    for category, color in zip(MEMORY_CATEGORIES, COLORS, strict=True):
        heights = [breakdown.get(category, 0) / GIB for _, breakdown in entries]
        ax.bar(labels, heights, bottom=bottoms, color=color, label=category)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=8)
    if capacity_bytes:
        ax.axhline(capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="GPU memory")
    if limit_bytes:
        share = f" ({limit_bytes / capacity_bytes:.0%})" if capacity_bytes else ""
        ax.axhline(limit_bytes / GIB, color="#d62728", linestyle=":", linewidth=1.2, label=f"planning limit{share}")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
