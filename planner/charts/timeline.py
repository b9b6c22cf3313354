"""`simulate --png`: one step as a Gantt chart that reads at any number of micro-batches and stages.

At 128-256 micro-batches every operation drawn is a hairline; what a reader
wants is the start of the step (warm-up), the end (cool-down, data-parallel
reduction, optimizer) and one look at the steady state. So the chart keeps
every interval of the first and last EDGE_MICRO_BATCHES micro-batches (and the
tails after the pipeline), and folds each stretch in which all stages only run
micro-batches in between: the stretch is cut out of the time axis and drawn as
a narrow hatched band that says how many micro-batches repeat in it and how
long it lasts. Intervals across a cut are clipped at it. A schedule with one
steady state (1F1B, interleaved, ZB-V) gets one fold; GPipe gets two (its
forwards, then its backwards).

With more than 2 * STAGES_AT_EACH_END + 1 stages the middle ones are folded the
same way (the critical stage is always kept). Lanes are those of
`planner.simulate.timeline`: per stage a compute lane (bubble shaded) and one
per kind of communication. The Perfetto trace (`planner.simulate.trace`)
holds the same intervals unfolded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.charts import pyplot, save_figure
from planner.simulate.timeline import Interval, Timeline

EDGE_MICRO_BATCHES = 2  # micro-batches drawn in full at each end of the step
FOLD_MIN_SHARE = 0.08  # a steady stretch shorter than this share of the step is drawn, not folded
FOLD_WIDTH_SHARE = 0.035  # the drawn width of a fold, as a share of the time kept
STAGES_AT_EACH_END = 3
LABEL_MIN_SHARE = 0.012  # an operation narrower than this share of the drawn axis carries no micro-batch number

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8C8C3C", "optimizer": "#8172B3", "bubble": "#E8E8E8",
          "TP": "#DD8452", "CP": "#E5AE38", "EP": "#64B5CD", "FSDP": "#C44E52", "offload": "#999999",
          "PP": "#937860", "DP": "#DA8BC3"}
LANE_LABELS = {"TP": "TP", "CP": "CP", "EP": "EP a2a", "FSDP": "FSDP", "offload": "offload", "PP": "PP send",
               "DP": "DP"}
LEGEND = (("F", "forward"), ("B", "backward"), ("W", "weight grad"), ("bubble", "bubble (idle)"),
          ("optimizer", "optimizer"), ("TP", "TP comm (exposed)"), ("CP", "CP comm (exposed)"),
          ("EP", "EP all-to-all (exposed)"), ("FSDP", "FSDP gather/scatter (exposed)"),
          ("offload", "host link copies"), ("PP", "PP send"), ("DP", "DP reduce / gather"))


@dataclass(frozen=True)
class Fold:
    """A stretch [start_s, end_s) of the step cut out of the chart; only middle micro-batches run in it."""

    start_s: float
    end_s: float
    micro_batches: int  # micro-batches with an operation wholly inside the fold, on the stage with the most

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def label(self) -> str:
        return f"steady state: {self.micro_batches} micro-batches, {self.duration_s:.3g} s folded"


@dataclass(frozen=True)
class StepChart:
    """What the step chart shows: the timeline, which stages and lanes are drawn, and what is folded."""

    timeline: Timeline
    title: str
    stages: tuple[int, ...]  # drawn, in order
    rows: tuple[tuple[int, str], ...]  # (stage, lane) top to bottom
    folds: tuple[Fold, ...]
    fold_width_s: float  # a fold's width on the drawn axis
    drawn: tuple[Interval, ...]  # intervals of drawn stages outside every fold, clipped at the folds' edges
    edge_micro_batches: tuple[int, ...]  # the micro-batches drawn in full

    @property
    def hidden_stages(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.timeline.pp) if s not in self.stages)

    @property
    def drawn_span_s(self) -> float:
        """Length of the drawn time axis: the step less what the folds cut, plus their bands."""
        return self.timeline.step_time_s - sum(f.duration_s - self.fold_width_s for f in self.folds)

    def x(self, t_s: float) -> float:
        """Where time t_s of the step lies on the drawn axis (a time inside a fold maps into its band)."""
        shift = 0.0
        for f in self.folds:
            if t_s >= f.end_s:
                shift += f.duration_s - self.fold_width_s
            elif t_s > f.start_s:
                return f.start_s - shift + self.fold_width_s * (t_s - f.start_s) / f.duration_s
        return t_s - shift

    @property
    def subtitle(self) -> str:
        t, b = self.timeline, self.timeline.time_breakdown_s
        return (f"step {t.step_time_s:.3g} s (stage {t.critical_stage} last): bubble {b.get('bubble', 0.0):.3g} s, "
                f"exposed comm {b.get('exposed_comm', 0.0):.3g} s; {t.micro_batches} micro-batches, {t.schedule}"
                + (f" v={t.virtual_stages}" if t.virtual_stages > 1 else ""))


def step_chart(timeline: Timeline, title: str = "") -> StepChart:
    """Fold the timeline's steady state and middle stages (module docstring)."""
    n = timeline.micro_batches
    k = min(EDGE_MICRO_BATCHES, n)
    edge = tuple(sorted({*range(k), *range(max(k, n - k), n)}))
    folds = _folds(timeline, set(edge))
    stages = _drawn_stages(timeline.pp, timeline.critical_stage)
    kept_s = timeline.step_time_s - sum(f.duration_s for f in folds)
    width = FOLD_WIDTH_SHARE * kept_s
    drawn = tuple(c for i in timeline.intervals if i.stage in stages for c in _clip(i, folds))
    rows = tuple((s, lane) for s in stages for lane in timeline.lanes)
    return StepChart(timeline, title, stages, rows, folds, width, drawn, edge)


def _folds(timeline: Timeline, edge: set[int]) -> tuple[Fold, ...]:
    """The stretches no interval of an edge micro-batch or a tail touches, long enough to fold."""
    kept = sorted((i.start_s, i.end_s) for i in timeline.intervals
                  if (i.micro_batch in edge) or (i.micro_batch is None and i.kind != "bubble"))
    gaps, reach = [], 0.0
    for start, end in kept:
        if start > reach:
            gaps.append((reach, start))
        reach = max(reach, end)
    out = []
    for start, end in gaps:
        if end - start < FOLD_MIN_SHARE * timeline.step_time_s:
            continue
        inside: dict[int, set[int]] = {}
        for i in timeline.intervals:
            if i.is_operation and i.start_s >= start and i.end_s <= end:
                inside.setdefault(i.stage, set()).add(i.micro_batch)
        out.append(Fold(start, end, max((len(mbs) for mbs in inside.values()), default=0)))
    return tuple(out)


def _drawn_stages(pp: int, critical: int) -> tuple[int, ...]:
    if pp <= 2 * STAGES_AT_EACH_END + 1:
        return tuple(range(pp))
    return tuple(sorted({*range(STAGES_AT_EACH_END), *range(pp - STAGES_AT_EACH_END, pp), critical}))


def _clip(interval: Interval, folds: tuple[Fold, ...]) -> list[Interval]:
    """The parts of an interval outside every fold."""
    parts = [(interval.start_s, interval.end_s)]
    for f in folds:
        parts = [piece for a, b in parts for piece in ((a, min(b, f.start_s)), (max(a, f.end_s), b)) if piece[1] > piece[0]]
    return [Interval(interval.stage, interval.kind, a, b, interval.chunk, interval.micro_batch) for a, b in parts]


# ---- drawing --------------------------------------------------------------------------------------------


COMPUTE_HEIGHT, LANE_HEIGHT, GAP = 1.0, 0.34, 0.5


def _row_positions(chart: StepChart) -> tuple[dict[tuple[int, str], tuple[float, float]], list[tuple[float, str]]]:
    """(stage, lane) -> (y, height), and the y of each folded-stages note."""
    positions, notes, y = {}, [], 0.0
    previous = None
    for stage, lane in chart.rows:
        if previous is not None and stage != previous:
            y += GAP
            if stage - previous > 1:
                notes.append((y + GAP / 2, f"stages {previous + 1}-{stage - 1} folded ({stage - previous - 1})"))
                y += 2 * GAP
        height = COMPUTE_HEIGHT if lane == "compute" else LANE_HEIGHT
        positions[(stage, lane)] = (y, height)
        y += height + 0.04
        previous = stage
    return positions, notes


def draw_step_chart(chart: StepChart):
    """The matplotlib Figure of a StepChart."""
    plt = pyplot()
    from matplotlib.patches import Patch

    positions, notes = _row_positions(chart)
    bottom = max(y + h for y, h in positions.values())
    height = 1.5 + 0.4 * bottom
    fig, ax = plt.subplots(figsize=(12, height))
    span = chart.drawn_span_s
    bars: dict[tuple[float, float, str, bool], list[tuple[float, float]]] = {}
    local = _local_chunks(chart.timeline)
    for i in chart.drawn:
        y, h = positions[(i.stage, i.lane)]
        key = i.kind if i.lane == "compute" else i.lane
        if i.is_operation and local.get(i.chunk, 0):  # a stage's later chunks in a lighter shade
            key = f"{key}{local[i.chunk]}"
        x0, x1 = chart.x(i.start_s), chart.x(i.end_s)
        bars.setdefault((y, h, key, i.kind == "bubble"), []).append((x0, x1 - x0))
        if i.is_operation and x1 - x0 > LABEL_MIN_SHARE * span:
            ax.text((x0 + x1) / 2, y + h / 2, str(i.micro_batch), ha="center", va="center", fontsize=6,
                    color="white")
    for (y, h, key, idle), spans in bars.items():
        # operations side by side keep a white seam; communication, often hairlines, keeps its colour
        edge = "#BBBBBB" if idle else "white" if h == COMPUTE_HEIGHT else "face"
        ax.broken_barh(spans, (y, h), facecolors=_color(key, chart.timeline.virtual_stages), edgecolor=edge,
                       linewidth=0.3, hatch="////" if idle else None, zorder=1 if idle else 2)
    for f in chart.folds:
        x0 = chart.x(f.start_s)
        ax.axvspan(x0, x0 + chart.fold_width_s, facecolor="white", edgecolor="#555555", hatch="\\\\", linewidth=0.6,
                   zorder=3)
        ax.text(x0 + chart.fold_width_s / 2, bottom / 2, f.label, rotation=90, ha="center", va="center",
                fontsize=8, zorder=4, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
    for y, note in notes:
        ax.text(0.0, y, f"  {note}", va="center", ha="left", fontsize=8, style="italic", color="#555555")
    ticks = [(y + h / 2, f"stage {s}" if lane == "compute" else LANE_LABELS[lane])
             for (s, lane), (y, h) in positions.items()]
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=7)
    for tick, (_, label) in zip(ax.get_yticklabels(), ticks, strict=True):
        if label.startswith("stage"):
            tick.set_fontweight("bold")
    ax.set_ylim(bottom + 0.1, -0.1)
    ax.set_xlim(0, span)
    _time_ticks(ax, chart)
    ax.set_xlabel("time in step (s)" + ("; hatched bands: folded steady state" if chart.folds else ""))
    ax.set_title(f"{chart.title}\n{chart.subtitle}" if chart.title else chart.subtitle, fontsize=9)
    used = {i.kind if i.lane == "compute" else i.lane for i in chart.drawn}
    legend = [Patch(facecolor=COLORS[k], label=label, hatch="////" if k == "bubble" else None,
                    edgecolor="#BBBBBB" if k == "bubble" else COLORS[k]) for k, label in LEGEND if k in used]
    if chart.timeline.virtual_stages > 1:
        legend.append(Patch(facecolor=_color("F1", 2), edgecolor="white", label="lighter: a stage's later chunk"))
    fig.legend(handles=legend, loc="lower center", ncol=min(len(legend), 8), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    return fig


def _local_chunks(timeline: Timeline) -> dict[int, int]:
    """chunk -> its index among its stage's chunks (0 for the first), from planner.layout's ownership."""
    from planner.layout import rank_chunks

    return {c: j for stage in range(timeline.pp)
            for j, c in enumerate(rank_chunks(timeline.schedule, timeline.pp, timeline.virtual_stages, stage))}


def _color(key: str, v: int):
    """A lane's colour; an operation of a stage's j-th chunk (key 'F1', 'B2') blended toward white."""
    if key in COLORS:
        return COLORS[key]
    from matplotlib.colors import to_rgb

    base, j = key[0], int(key[1:])
    share = 0.45 * j / max(1, v - 1)
    return tuple(c + (1 - c) * share for c in to_rgb(COLORS[base]))


def _time_ticks(ax, chart: StepChart) -> None:
    """Ticks at round times of the step on each piece the folds leave, labelled with the real time."""
    from matplotlib.ticker import MaxNLocator

    edges = [0.0, *(t for f in chart.folds for t in (f.start_s, f.end_s)), chart.timeline.step_time_s]
    pieces = list(zip(edges[::2], edges[1::2], strict=True))
    kept = sum(b - a for a, b in pieces) or 1.0
    ticks = []
    for a, b in pieces:
        bins = max(1, round(10 * (b - a) / kept))
        ticks += [t for t in MaxNLocator(bins).tick_values(a, b) if a - 1e-12 <= t <= b + 1e-12]
    ax.set_xticks([chart.x(t) for t in ticks], [f"{t:.3g}" for t in ticks], fontsize=7)


def plot_step_chart(chart: StepChart, path: str | Path) -> None:
    save_figure(draw_step_chart(chart), path)
