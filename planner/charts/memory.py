"""`plan --png`: memory per GPU by category, stacked against the GPU's capacity.

Two panels for one plan: the chosen layout's ranks by pipeline stage (first,
middle and last stage, and the worst one when it is another; with pp 1 every
rank holds the same), each at its own peak phase; and the ranked layouts side by
side (each at its worst rank). The GPU's memory is a dashed line, the planning
limit (capacity less --memory-headroom) a dotted one, so a bar above it reads as
"does not fit".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.charts import pyplot, save_figure
from planner.plan import MEMORY_CATEGORIES
from topologies.errors import UsageError
from topologies.hardware import GIB

# One colour per category, in MEMORY_CATEGORIES order (matplotlib's tab10).
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#7f7f7f")
YLABEL = "GiB per GPU"
LABEL_WIDTH = 14  # characters per line of a layout under its bar


@dataclass(frozen=True)
class MemoryBar:
    label: str
    breakdown_bytes: dict[str, int]  # MEMORY_CATEGORIES -> bytes
    marked: bool = False  # the worst rank (or the chosen layout): drawn with a black outline

    @property
    def total_bytes(self) -> int:
        return sum(self.breakdown_bytes.get(c, 0) for c in MEMORY_CATEGORIES)


@dataclass(frozen=True)
class MemoryPanel:
    title: str
    bars: tuple[MemoryBar, ...]


@dataclass(frozen=True)
class MemoryChart:
    title: str
    panels: tuple[MemoryPanel, ...]
    capacity_bytes: int | None = None
    limit_bytes: int | None = None  # the planning limit: capacity less the headroom a plan leaves free


def stage_panel(memory, layout, title: str = "chosen layout, by pipeline stage") -> MemoryPanel:
    """First, middle and last stage (and the worst) of a MemoryEstimate, each at its own peak phase."""
    pp = layout.pp
    per_stage_ranks = layout.world_size // pp
    if pp == 1:
        picks = {0: "every rank"}
    else:
        picks = {0: "first stage", pp - 1: "last stage"}
        if pp > 2:
            picks.setdefault(pp // 2, "middle stage")
        picks.setdefault(memory.worst_stage, "worst stage")
    bars = []
    for stage in sorted(picks):
        first = stage * per_stage_ranks
        ranks = f"rank {first}" if per_stage_ranks == 1 else f"ranks {first}-{first + per_stage_ranks - 1}"
        name = picks[stage] if pp == 1 else f"{picks[stage]} ({stage})"
        worst = stage == memory.worst_stage and pp > 1
        bars.append(MemoryBar(f"{name}\n{ranks}" + ("\nworst" if worst and picks[stage] != "worst stage" else ""),
                              dict(memory.per_stage[stage]), marked=worst))
    return MemoryPanel(title, tuple(bars))


def ranked_panel(ranked, short, title: str = "ranked layouts, worst rank") -> MemoryPanel:
    """One bar per ranked layout (planner.search.search.Scored), the chosen (first) one marked."""
    import textwrap

    return MemoryPanel(title, tuple(MemoryBar(textwrap.fill(f"#{i + 1} {short(s.layout)}", LABEL_WIDTH),
                                              dict(s.result.memory.breakdown_bytes), marked=i == 0)
                                    for i, s in enumerate(ranked)))


def draw_memory_chart(chart: MemoryChart):
    if not chart.panels or not all(p.bars for p in chart.panels):
        raise UsageError("a memory chart needs at least one bar in every panel")
    plt = pyplot()
    widths = [max(2, len(p.bars)) for p in chart.panels]
    fig, axes = plt.subplots(1, len(chart.panels), sharey=True, squeeze=False, gridspec_kw={"width_ratios": widths},
                             figsize=(max(5.0, 1.15 * sum(widths) + 3.0), 4.8))
    for ax, panel in zip(axes[0], chart.panels, strict=True):
        labels = [b.label for b in panel.bars]
        bottoms = [0.0] * len(labels)
        for category, color in zip(MEMORY_CATEGORIES, COLORS, strict=True):
            heights = [b.breakdown_bytes.get(category, 0) / GIB for b in panel.bars]
            ax.bar(labels, heights, bottom=bottoms, color=color, label=category, width=0.65)
            bottoms = [lo + h for lo, h in zip(bottoms, heights, strict=True)]
        for x, bar in enumerate(panel.bars):
            total = bar.total_bytes / GIB
            ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=8,
                        fontweight="bold" if bar.marked else "normal")
            if bar.marked:
                ax.bar([x], [total], width=0.65, fill=False, edgecolor="black", linewidth=1.4)
        if chart.capacity_bytes:
            ax.axhline(chart.capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="GPU memory")
        if chart.limit_bytes:
            share = f" ({chart.limit_bytes / chart.capacity_bytes:.0%})" if chart.capacity_bytes else ""
            ax.axhline(chart.limit_bytes / GIB, color="#d62728", linestyle=":", linewidth=1.2,
                       label=f"planning limit{share}")
        ax.set_title(panel.title, fontsize=9)
        plt.setp(ax.get_xticklabels(), fontsize=7)
        ax.margins(y=0.08)
    axes[0][0].set_ylabel(YLABEL)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle(chart.title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_memory_chart(chart: MemoryChart, path: str | Path) -> None:
    save_figure(draw_memory_chart(chart), path)
