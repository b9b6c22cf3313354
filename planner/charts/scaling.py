"""`plan --gpus auto|LO-HI --png`: what each GPU count buys, against the count on a log axis.

Panels: tokens/s in total (with linear scaling from the smallest count that fits
as a dotted reference), tokens/s per GPU, and with `--tokens` the days to train
them and the cost at `--price-per-gpu-hour` (GPU-hours without a price). The
recommended count (`planner.search.sweep.Sweep.recommended`: most tokens/s per
GPU, so the cheapest per token) is a star in every panel; counts that cannot
hold the model are shaded; the counts past the one after which a doubling
stops paying (less than SCALING_WORTH_IT of twice the tokens/s) are shaded red.

`band`: the relative uncertainty of a prediction, (low, high) factors on
tokens/s, drawn as a shaded band around every curve where a point carries one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planner.charts import pyplot, save_figure, si
from planner.search.sweep import SCALING_WORTH_IT, Sweep, SweepPoint, training_cost

CURRENCY = "$"  # --price-per-gpu-hour is read as dollars


@dataclass(frozen=True)
class ScalingPoint:
    gpus: int
    tokens_per_s: float  # 0 when nothing fits
    fits: bool
    days: float | None = None  # to train ScalingChart.tokens
    gpu_hours: float | None = None
    cost: float | None = None  # at ScalingChart.price_per_gpu_hour
    band: tuple[float, float] | None = None  # (low, high) factors on tokens_per_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus


@dataclass(frozen=True)
class Panel:
    key: str  # tokens_per_s, tokens_per_s_per_gpu, days, cost, gpu_hours
    ylabel: str
    title: str


@dataclass(frozen=True)
class ScalingChart:
    title: str
    points: tuple[ScalingPoint, ...]  # every searched count, in order
    recommended_gpus: int
    smallest_fit_gpus: int
    stops_paying_after: int | None  # the last count whose doubling still paid (None: every one did)
    ruled_out: tuple[int, ...]  # counts skipped because model state alone exceeds memory
    tokens: float | None = None
    price_per_gpu_hour: float | None = None
    xlabel: str = "GPUs (log scale)"

    @property
    def fitting(self) -> tuple[ScalingPoint, ...]:
        return tuple(p for p in self.points if p.fits)

    @property
    def recommended(self) -> ScalingPoint:
        return next(p for p in self.points if p.gpus == self.recommended_gpus)

    @property
    def panels(self) -> tuple[Panel, ...]:
        out = [Panel("tokens_per_s", "tokens/s", "tokens/s, all GPUs"),
               Panel("tokens_per_s_per_gpu", "tokens/s per GPU", "tokens/s per GPU")]
        if self.tokens is not None:
            out.append(Panel("days", "days", f"days to train {si(self.tokens)} tokens"))
            out.append(Panel("cost", f"cost ({CURRENCY})", f"cost at {CURRENCY}{self.price_per_gpu_hour:g} per GPU-hour")
                       if self.price_per_gpu_hour is not None else
                       Panel("gpu_hours", "GPU-hours", f"GPU-hours to train {si(self.tokens)} tokens"))
        return tuple(out)

    def values(self, key: str) -> list[tuple[int, float]]:
        """(GPUs, value) of the fitting counts for a panel's key."""
        return [(p.gpus, getattr(p, key)) for p in self.fitting]

    def band_of(self, point: ScalingPoint, key: str) -> tuple[float, float] | None:
        """The panel's value range for a point's band; times and costs scale as 1 / tokens/s."""
        if point.band is None:
            return None
        low, high = point.band
        value = getattr(point, key)
        return (value * low, value * high) if key.startswith("tokens") else (value / high, value / low)

    @property
    def x_counts(self) -> list[int]:
        """The counts on the x axis: every count searched from the largest that does not fit upward."""
        counts = sorted({p.gpus for p in self.points} | set(self.ruled_out))
        below = [n for n in counts if n < self.smallest_fit_gpus]
        return [n for n in counts if not below or n >= below[-1]]

    @property
    def no_fit_label(self) -> str:
        return f"does not fit below {self.smallest_fit_gpus}"

    def log_y(self, key: str) -> bool:
        """A log axis where the values span more than a decade (tokens/s over 1-1024 GPUs), linear otherwise."""
        values = [v for _, v in self.values(key) if v]
        return bool(values) and max(values) / min(values) > 10

    @property
    def recommended_label(self) -> str:
        p = self.recommended
        text = f"recommended: {p.gpus} GPUs, {si(p.tokens_per_s_per_gpu)} tok/s/GPU"
        if p.cost is not None:
            text += f", {CURRENCY}{si(p.cost)}"
        return text + " (cheapest per token)"

    @property
    def scaling_label(self) -> str:
        last = self.fitting[-1].gpus
        if self.stops_paying_after is None:
            return f"every doubling pays up to {last} GPUs (>= {SCALING_WORTH_IT:.0%} of 2x tokens/s)"
        return (f"scaling stops paying after {self.stops_paying_after} GPUs "
                f"(next doubling < {SCALING_WORTH_IT:.0%} of 2x tokens/s)")


def scaling_chart(found: Sweep, title: str, tokens: float | None = None, price_per_gpu_hour: float | None = None,
                  band: Callable[[SweepPoint], tuple[float, float] | None] | None = None) -> ScalingChart:
    """The chart of a sweep with at least one fitting count (`plan --gpus auto` refuses one without)."""
    points = []
    for p in found.points:
        cost = training_cost(tokens, p.tokens_per_s, p.gpus, price_per_gpu_hour) if tokens and p.fits else {}
        points.append(ScalingPoint(p.gpus, p.tokens_per_s, p.fits, cost.get("days"), cost.get("gpu_hours"),
                                   cost.get("cost"), band(p) if band and p.fits else None))
    return ScalingChart(title, tuple(points), found.recommended.gpus, found.smallest_fit.gpus,
                        found.stopped_paying_at, tuple(found.ruled_out), tokens, price_per_gpu_hour)


def draw_scaling_chart(chart: ScalingChart):
    plt = pyplot()
    from matplotlib.ticker import FixedLocator, LogLocator, NullLocator

    panels = chart.panels
    cols = 2
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.6 * rows + 0.8), squeeze=False)
    counts = chart.x_counts
    lo, hi = counts[0] / 1.4, counts[-1] * 1.4
    too_small = counts[0] < chart.smallest_fit_gpus
    best = chart.recommended
    for ax, panel in zip(axes.flat, panels, strict=False):
        xs, ys = zip(*chart.values(panel.key), strict=True)
        ax.plot(xs, ys, "o-", color="#1f77b4", label=panel.ylabel, zorder=3)
        bands = [(p.gpus, chart.band_of(p, panel.key)) for p in chart.fitting if p.band is not None]
        if bands:
            ax.fill_between([g for g, _ in bands], [b[0] for _, b in bands], [b[1] for _, b in bands],
                            color="#1f77b4", alpha=0.18, linewidth=0, label="uncertainty")
        if panel.key == "tokens_per_s":
            first = chart.fitting[0]
            ax.plot(xs, [first.tokens_per_s * x / first.gpus for x in xs], ":", color="0.45",
                    label=f"linear from {first.gpus} GPUs")
        ax.plot([best.gpus], [getattr(best, panel.key)], marker="*", markersize=16, color="#d62728",
                linestyle="none", zorder=4, label=f"recommended ({best.gpus})")
        if too_small:
            ax.axvspan(lo, chart.smallest_fit_gpus / 1.4, color="0.85", zorder=0)
            ax.text((lo * chart.smallest_fit_gpus / 1.4) ** 0.5, 0.5, chart.no_fit_label, rotation=90, ha="center",
                    va="center", fontsize=7, color="0.35", transform=ax.get_xaxis_transform())
        if chart.stops_paying_after is not None:
            ax.axvspan(chart.stops_paying_after * 1.41, hi, color="#d62728", alpha=0.08, zorder=0)
            ax.axvline(chart.stops_paying_after * 1.41, color="#d62728", linewidth=0.8, linestyle="--")
            ax.text((chart.stops_paying_after * 1.41 * hi) ** 0.5, 0.5, "stops paying", rotation=90, ha="center",
                    va="center", fontsize=7, color="#a02020", transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(FixedLocator(counts))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(n) for n in counts], fontsize=7)
        if chart.log_y(panel.key):
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # labels within a decade too
        ax.yaxis.set_major_formatter(lambda v, _, key=panel.key: (CURRENCY if key == "cost" else "") + si(v))
        ax.yaxis.set_minor_formatter(lambda v, _: "")
        ax.set_title(panel.title, fontsize=9)
        ax.set_ylabel(panel.ylabel)
        ax.set_xlabel(chart.xlabel)
        ax.grid(True, which="major", linewidth=0.3)
        if panel is panels[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{chart.title}\n{chart.recommended_label}; {chart.scaling_label}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_scaling_chart(chart: ScalingChart, path: str | Path) -> None:
    save_figure(draw_scaling_chart(chart), path)
