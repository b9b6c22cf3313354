"""`report RUN [RUN...] --png`: what the runs measured, over their steps and next to their plans' predictions.

Four panels, every run in its own colour:
  loss over steps           warm-up steps (not counted) drawn hollow
  tokens/s over steps       measured, with the prediction as a dashed line
  step time                 measured (median of the counted steps) next to predicted, the error above
  peak memory               predicted tensor bytes by category next to what the run recorded; on CPU ranks
                            the run records the process's resident set (interpreter and libraries
                            included), drawn hatched and not compared (executor.validate.report)

Built from the report documents (`build_report`) and their metric rows; pure
Python until drawn (matplotlib imported there), like `report` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.validate.memory import TENSOR_CATEGORIES
from planner.charts import pyplot, save_figure
from planner.charts.memory import COLORS as CATEGORY_COLORS
from planner.plan import MEMORY_CATEGORIES
from topologies.hardware import GIB

MARKERS = ("o", "s", "^", "D", "v", "P")
PANEL_LABELS = {"loss": ("step", "loss"), "tokens_per_s": ("step", "tokens/s"),
                "step_time": ("run", "step time (s)"), "memory": ("run", "peak memory (GiB)")}


@dataclass(frozen=True)
class RunCurves:
    """One run's series and its figures against the prediction."""

    label: str
    steps: tuple[int, ...]
    loss: tuple[float | None, ...]
    tokens_per_s: tuple[float, ...]  # tokens per step / the step's time, as `execute` logs it
    counted: tuple[bool, ...]  # past the warm-up and not the first step after a resume
    measured_step_time_s: float
    predicted_step_time_s: float
    predicted_tokens_per_s: float
    measured_peak_bytes: int | None
    predicted_breakdown_bytes: dict[str, int]  # tensor categories: what max_memory_allocated sees
    memory_compared: bool  # False on CPU ranks, whose recorded peak is the resident set

    @property
    def predicted_peak_bytes(self) -> int:
        return sum(self.predicted_breakdown_bytes.values())

    @property
    def step_time_error(self) -> float:
        return (self.predicted_step_time_s - self.measured_step_time_s) / self.measured_step_time_s


@dataclass(frozen=True)
class ReportChart:
    title: str
    runs: tuple[RunCurves, ...]


def run_curves(report: dict[str, Any], rows: list[dict[str, Any]], label: str) -> RunCurves:
    """The curves of one run from its report document and the rows it was built from."""
    from executor.components.measure import counted_rows

    meas, pred = report["measured"], report["predicted"]
    tokens_per_step = meas["tokens_per_s"] * meas["step_time_s"]
    counted_steps = {r["step"] for r in counted_rows(rows, report["warmup_steps"])}
    breakdown = pred.get("memory_breakdown_bytes") or {}
    tensors = {c: int(breakdown.get(c, 0)) for c in TENSOR_CATEGORIES}
    if not breakdown:  # a prediction without categories: its tensor peak as one block
        tensors = {"activations": int(pred["tensor_peak_bytes"])}
    return RunCurves(
        label=label, steps=tuple(r["step"] for r in rows), loss=tuple(r.get("loss") for r in rows),
        tokens_per_s=tuple(tokens_per_step / r["step_time_s"] for r in rows),
        counted=tuple(r["step"] in counted_steps for r in rows), measured_step_time_s=meas["step_time_s"],
        predicted_step_time_s=pred["step_time_s"], predicted_tokens_per_s=pred["tokens_per_s"],
        measured_peak_bytes=meas["peak_memory_bytes"], predicted_breakdown_bytes=tensors,
        memory_compared=report["error"]["peak_memory_bytes"] is not None)


def report_chart(reports: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> ReportChart:
    """One chart over runs given as (report document, metric rows), labelled by their directories."""
    labels = [Path(doc["run_dir"]).name or doc["run_dir"] for doc, _ in reports]
    if len(set(labels)) < len(labels):  # two runs of the same name in different places
        labels = [doc["run_dir"] for doc, _ in reports]
    runs = tuple(run_curves(doc, rows, label) for (doc, rows), label in zip(reports, labels, strict=True))
    first = reports[0][0]
    if len(runs) == 1:
        lay = first["layout"]
        title = (f"{first['model']} on {first['cluster']}: tp {lay['tp']}, pp {lay['pp']}, dp {lay['dp_replicate']}"
                 f"x{lay['dp_shard']}, ZeRO-{lay['zero_stage']}; {first['steps_counted']} steps counted")
    else:
        models = sorted({doc["model"] for doc, _ in reports})
        title = f"{len(runs)} runs of {', '.join(models)}"
    return ReportChart(title, runs)


def draw_report_chart(chart: ReportChart):
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax_loss, ax_tps, ax_time, ax_mem = axes.flat
    for i, run in enumerate(chart.runs):
        color, marker = f"C{i}", MARKERS[i % len(MARKERS)]  # a shape per run: equal losses stay visible
        _series(ax_loss, run.steps, run.loss, run.counted, color, marker, run.label)
        _series(ax_tps, run.steps, run.tokens_per_s, run.counted, color, marker, f"{run.label} measured")
        ax_tps.axhline(run.predicted_tokens_per_s, color=color, linestyle="--", linewidth=1,
                       label=f"{run.label} predicted")
    names = [r.label for r in chart.runs]
    x = range(len(chart.runs))
    ax_time.bar([i - 0.2 for i in x], [r.predicted_step_time_s for r in chart.runs], width=0.4, color="0.65",
                label="predicted")
    ax_time.bar([i + 0.2 for i in x], [r.measured_step_time_s for r in chart.runs], width=0.4,
                color=[f"C{i}" for i in x], label="measured (median)")
    for i, r in zip(x, chart.runs, strict=True):
        top = max(r.predicted_step_time_s, r.measured_step_time_s)
        ax_time.annotate(f"{100 * r.step_time_error:+.0f}%", (i, top), ha="center", va="bottom", fontsize=8)
    _memory(ax_mem, chart.runs)
    for ax, key in ((ax_loss, "loss"), (ax_tps, "tokens_per_s"), (ax_time, "step_time"), (ax_mem, "memory")):
        xlabel, ylabel = PANEL_LABELS[key]
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.legend(fontsize=7, **({"loc": "upper left", "ncol": 2} if key == "memory" else {}))
    for ax in (ax_time, ax_mem):
        ax.set_xticks(list(x), names, fontsize=8)
        ax.margins(y=0.15)
    ax_mem.set_ylim(top=ax_mem.get_ylim()[1] * 1.6)  # room for the categories' legend above the bars
    ax_loss.set_title("loss (hollow: warm-up, not counted)", fontsize=9)
    ax_tps.set_title("tokens/s: measured, predicted dashed", fontsize=9)
    ax_time.set_title("step time: predicted vs measured (error of the prediction)", fontsize=9)
    ax_mem.set_title("peak memory per GPU: predicted tensors vs recorded", fontsize=9)
    fig.suptitle(chart.title, fontsize=10)
    fig.tight_layout()
    return fig


def _series(ax, steps, values, counted, color: str, marker: str, label: str) -> None:
    points = [(s, v, c) for s, v, c in zip(steps, values, counted, strict=True) if v is not None]
    if not points:
        return
    ax.plot([s for s, _, _ in points], [v for _, v, _ in points], "-", color=color, linewidth=1.2, marker=marker,
            markersize=4, markevery=[i for i, (_, _, c) in enumerate(points) if c], label=label)
    ax.plot([s for s, _, c in points if not c], [v for _, v, c in points if not c], marker, markersize=5,
            markerfacecolor="white", markeredgecolor=color)


def _memory(ax, runs: tuple[RunCurves, ...]) -> None:
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for i, run in enumerate(runs):
        bottom = 0.0
        for category, color in zip(MEMORY_CATEGORIES, CATEGORY_COLORS, strict=True):
            value = run.predicted_breakdown_bytes.get(category, 0) / GIB
            if value:
                ax.bar(i - 0.2, value, bottom=bottom, width=0.4, color=color, label=once(f"predicted {category}"))
                bottom += value
        if run.measured_peak_bytes is not None:
            recorded = run.measured_peak_bytes / GIB
            ax.bar(i + 0.2, recorded, width=0.4, color=f"C{i}" if run.memory_compared else "white",
                   edgecolor=f"C{i}", hatch=None if run.memory_compared else "//",
                   label=once("recorded (allocated tensors)" if run.memory_compared else
                              "recorded resident set (CPU ranks: not compared)"))
            ax.annotate(f"{recorded:.3g}", (i + 0.2, recorded), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{bottom:.3g}", (i - 0.2, bottom), ha="center", va="bottom", fontsize=8)


def plot_report_chart(chart: ReportChart, path: str | Path) -> None:
    save_figure(draw_report_chart(chart), path)
