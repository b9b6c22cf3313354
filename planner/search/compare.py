"""`meshplan compare`: the best layout of each cluster or what-if variant, side by side.

Variants are the clusters given, crossed with every --what-if value (several
--what-if keys multiply). A what-if key is either a cluster field (any key
`--set` accepts: gpu, nic_gbit_per_s, ...) or one of seq_len, global_batch,
gpus. Each variant runs the full search; a variant where nothing fits is
shown with its shortfall instead of failing the whole comparison.

Speed-up is tokens/s against the first feasible variant (the baseline).
Cost per million tokens = price per GPU-hour * GPUs / 3600 / tokens_per_s * 1e6,
with one price for every variant or one per variant (GPUs do not cost the same).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from planner.charts import save_figure
from planner.figures import percent, sig, thousands
from planner.search.candidates import Pins
from topologies.errors import InfeasibleError, UsageError
from topologies.hardware import GIB

RUN_KEYS = ("seq_len", "global_batch", "gpus")  # what-if keys that are not cluster fields


@dataclass(frozen=True)
class Variant:
    label: str
    cluster: str  # preset name or TOML path
    overrides: dict[str, str] = field(default_factory=dict)  # --set and cluster what-ifs
    run: dict[str, int] = field(default_factory=dict)  # seq_len / global_batch / gpus what-ifs


@dataclass(frozen=True)
class Row:
    """One variant's outcome: its best layout, or why none fits."""

    variant: Variant
    gpus: int
    gpu_name: str
    best: Any = None  # planner.search.search.Scored
    error: str = ""
    speedup: float | None = None
    price_per_gpu_hour: float | None = None
    cost_per_million_tokens: float | None = None
    uncertainty: dict[str, Any] = field(default_factory=dict)  # planner.accuracy.bands.uncertainty_json

    @property
    def band(self) -> str:
        """'±6.2%', or 'n/v' where no bench validates the engine on this GPU family."""
        u = self.uncertainty
        return f"±{percent(u['band'], 2)}" if u.get("validated") else "n/v"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"label": self.variant.label, "cluster": self.variant.cluster,
                                "overrides": dict(self.variant.overrides), **self.variant.run,
                                "gpus": self.gpus, "gpu": self.gpu_name}
        if self.best is None:
            return {**data, "feasible": False, "error": self.error}
        return {**data, "feasible": True, "uncertainty": self.uncertainty,
                "global_batch_size": self.best.training.global_batch_size,
                "seq_len": self.best.training.seq_len, "parallel": self.best.layout.to_json(),
                "prediction": self.best.result.prediction().to_json(), "speedup": self.speedup,
                "price_per_gpu_hour": self.price_per_gpu_hour, "cost_per_million_tokens": self.cost_per_million_tokens}


def parse_what_if(items: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """'KEY=V1,V2' -> [(KEY, [V1, V2])]; malformed items are a UsageError naming the item."""
    parsed = []
    for item in items:
        key, sep, values = item.partition("=")
        options = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not options:
            raise UsageError(f"--what-if {item!r} must look like KEY=V1,V2,... (e.g. nic_gbit_per_s=200,400)")
        if key.strip() in RUN_KEYS:
            for v in options:
                if not v.isdigit() or int(v) < 1:
                    raise UsageError(f"--what-if {key.strip()} values must be positive integers, got {v!r}")
        parsed.append((key.strip(), options))
    return parsed


def variants(clusters: str, overrides: dict[str, str], what_if: list[tuple[str, list[str]]]) -> list[Variant]:
    names = [c.strip() for c in clusters.split(",") if c.strip()]
    if not names:
        raise UsageError("--cluster needs at least one preset name or TOML path")
    out = []
    for name in names:
        for combo in itertools.product(*[[(k, v) for v in vs] for k, vs in what_if]):
            run = {k: int(v) for k, v in combo if k in RUN_KEYS}
            cluster_keys = {k: v for k, v in combo if k not in RUN_KEYS}
            label = " ".join([name] + [f"{k}={v}" for k, v in combo]) if (len(names) > 1 or not combo) else \
                " ".join(f"{k}={v}" for k, v in combo)
            out.append(Variant(label, name, {**overrides, **cluster_keys}, run))
    return out


def compare_variants(model_name: str, gpus: int, clusters: str, overrides: tuple[str, ...],
                     what_if: tuple[str, ...], seq_len: int | None, global_batch: int | None, engine: str,
                     calibration: str | None, price_per_gpu_hour: str | None, precision: str = "bf16",
                     allow_long_context: bool = False, progress=None, offload: str | None = None,
                     finetune: dict[str, object] | None = None) -> list[Row]:
    """Search every variant; rows in variant order with speed-up and cost filled in.

    finetune: TrainingSpec's LoRA fields (planner.cli.finetune), the same for every variant.

    progress: a `topologies.terminal.Progress` told the number of variants and each one searched.
    """
    from planner.accuracy.bands import uncertainty_json
    from planner.model.context import check_context
    from planner.model.load import load_model
    from planner.search.explain import no_layout_error
    from planner.search.search import search
    from planner.simulate.calibration import load_calibration
    from planner.training import default_seq_len
    from topologies.cluster_load import load_cluster, parse_overrides

    model = load_model(model_name)
    todo = variants(clusters, parse_overrides(overrides), parse_what_if(what_if))
    prices = parse_prices(price_per_gpu_hour, len(todo))
    rows = []
    if progress is not None:
        progress.update(total=len(todo))
    pins = Pins(offload=offload)
    for v in todo:
        if progress is not None:
            progress.describe(v.label)
        n = v.run.get("gpus", gpus)
        cluster = load_cluster(v.cluster, n, v.overrides)
        seq = v.run.get("seq_len", seq_len) or default_seq_len(model.max_seq_len)
        check_context(model, seq, allow_long_context, "--what-if seq_len" if "seq_len" in v.run else "--seq-len")
        profile = load_calibration(calibration, cluster.gpu)
        result = search(model, cluster, seq, v.run.get("global_batch", global_batch), pins, engine, profile, top_k=1,
                        precision=precision, recipe=dict(finetune or {}))
        if progress is not None:
            progress.advance()
        if result.ranked:
            rows.append(Row(v, cluster.world_size, cluster.gpu.name, best=result.best,
                            uncertainty=uncertainty_json(engine, cluster.gpu.name, model.moe is not None)))
            continue
        error = no_layout_error(result, pins, cluster.world_size, engine)
        if not isinstance(error, InfeasibleError):
            raise error
        rows.append(Row(v, cluster.world_size, cluster.gpu.name, error=str(error)))
    if all(r.best is None for r in rows):
        raise InfeasibleError("no variant has a feasible layout: " + "; ".join(f"{r.variant.label}: {r.error}"
                                                                                for r in rows))
    return _with_ratios(rows, prices)


def parse_prices(text: str | None, n_variants: int) -> list[float | None]:
    """'2.5' (every variant) or '1.8,2.5,3.5' (one per variant, in order) -> a price per variant."""
    if text is None:
        return [None] * n_variants
    try:
        prices = [float(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"--price-per-gpu-hour {text!r} must be a number or one number per variant") from None
    if any(not 0 < p < float("inf") for p in prices) or len(prices) not in (1, n_variants):  # NaN fails too
        raise UsageError(f"--price-per-gpu-hour {text!r}: give one positive price, or {n_variants} (one per variant)")
    return prices * n_variants if len(prices) == 1 else prices


def _with_ratios(rows: list[Row], prices: list[float | None]) -> list[Row]:
    base = next(r for r in rows if r.best is not None).best.result.tokens_per_s
    out = []
    for r, price in zip(rows, prices, strict=True):
        if r.best is None:
            out.append(r)
            continue
        tps = r.best.result.tokens_per_s
        cost = price * r.gpus / 3600.0 / tps * 1e6 if price is not None else None
        out.append(Row(r.variant, r.gpus, r.gpu_name, r.best, speedup=tps / base, price_per_gpu_hour=price,
                       cost_per_million_tokens=cost, uncertainty=r.uncertainty))
    return out


def print_compare(rows: list[Row], out, png: str | None) -> None:
    from rich import box
    from rich.table import Table

    from planner.search.explain import short

    if not out.is_terminal:  # a pipe or file has no width to respect: do not squeeze the table
        out.width = max(out.width, 140)
    table = Table(title="best layout per variant (speed-up vs the first feasible)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    priced = any(r.cost_per_million_tokens is not None for r in rows)
    for col in ["variant", "GPUs", "layout", "step s", "band", "tokens/s", "speed-up", "MFU", "GiB"] + \
               (["$/M tokens"] if priced else []):
        table.add_column(col, justify="left" if col in ("variant", "layout") else "right",
                         no_wrap=col != "layout")
    for r in rows:
        if r.best is None:
            table.add_row(r.variant.label, f"{r.gpus} x {r.gpu_name}", f"[red]{r.error}[/]",
                          *["-"] * (6 + priced))
            continue
        res = r.best.result
        table.add_row(r.variant.label, f"{r.gpus} x {r.gpu_name}", short(r.best.layout), sig(res.step_time_s),
                      r.band, thousands(res.tokens_per_s), f"{sig(r.speedup)}x", percent(res.mfu),
                      sig(res.memory.peak_bytes / GIB), *([sig(r.cost_per_million_tokens)] if priced else []))
    out.print(table)
    if png:
        out.print(f"wrote chart to {png}")


CURRENCY = "$"  # --price-per-gpu-hour is read as dollars on the chart's cost axis


def plot_compare(rows: list[Row], path: str, title: str = "") -> None:
    """Bar chart of tokens/s per variant (and cost per million tokens when priced); matplotlib imported here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    feasible = [r for r in rows if r.best is not None]
    labels = [r.variant.label for r in feasible]
    priced = all(r.cost_per_million_tokens is not None for r in feasible)
    fig, axes = plt.subplots(1, 2 if priced else 1, figsize=(6 + 1.2 * len(labels) * (2 if priced else 1), 4.5),
                             squeeze=False)
    ax = axes[0][0]
    bars = ax.bar(labels, [r.best.result.tokens_per_s for r in feasible], color="#1f77b4")
    for bar, r in zip(bars, feasible, strict=True):
        ax.annotate(f"{r.speedup:.2f}x\nMFU {r.best.result.mfu:.0%}", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput (speed-up vs first)")
    if priced:
        axes[0][1].bar(labels, [r.cost_per_million_tokens for r in feasible], color="#ff7f0e")
        axes[0][1].set_ylabel(f"cost per million tokens ({CURRENCY})")
        axes[0][1].yaxis.set_major_formatter(lambda v, _: f"{CURRENCY}{v:,.2f}")
        axes[0][1].set_title("cost at the given price per GPU-hour")
    for a in axes[0]:
        a.tick_params(axis="x", labelrotation=20)
        a.margins(y=0.15)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
