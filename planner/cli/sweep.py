"""`plan --gpus auto | LO-HI`: the GPU-count sweep's printing, and "needs at least N GPUs" for a plan that does not fit.

The sweep itself is `planner.search.sweep`; this module runs it through
`planner.cli.plan.search_at` (the same inputs as a one-count plan) and prints
or writes what it found: -o gets the smallest fitting count's plan, --png the
scaling chart (`planner.charts.scaling`).
"""

from __future__ import annotations

from planner.accuracy.bands import band_for, band_words, uncertainty_json
from planner.figures import percent, thousands
from planner.search.sweep import (
    SCALING_WORTH_IT,
    GpuRange,
    Sweep,
    allowed_counts,
    describe_cost,
    sweep,
    training_cost,
)
from topologies.errors import InfeasibleError, UsageError
from topologies.terminal import console, emit_json


def sweep_request(request, gpu_range: GpuRange, quiet: bool = False) -> tuple[Sweep, dict[int, tuple]]:
    """The sweep of `request` over `gpu_range` (InfeasibleError when no count fits) and, per count searched,
    its (model, cluster). A progress line on a terminal names the count being searched (not with `quiet`)."""
    from planner.cli.request import node_size, search_at
    from topologies.terminal import Progress

    counts = allowed_counts(node_size(request), gpu_range.lo, gpu_range.hi)
    if not counts:
        raise UsageError(f"--gpus {gpu_range.lo}-{gpu_range.hi}: no whole-node or power-of-two count of cluster "
                         f"{request.cluster!r} lies in that range; widen it")
    built: dict[int, tuple] = {}
    with Progress("GPU counts", unit="searched", quiet=quiet) as bar:
        def at(n: int):
            bar.describe(f"searching {n} GPUs")
            model, cluster, result = search_at(request, n, top=1)
            built[n] = (model, cluster)
            bar.advance()
            return result

        found = sweep(counts, at, gpu_range.auto, state_bound=request.pins.offload in (None, "none"))
    if found.smallest_fit is None:
        last = found.points[-1] if found.points else None
        miss = last.result.near_miss if last else None
        detail = (f"; at {last.gpus} GPUs the closest layout needs {miss.needed_bytes / 2**30:.1f} GiB per GPU"
                  if last and miss else "")
        raise InfeasibleError(f"no GPU count from {counts[0]} to {counts[-1]} fits {request.model}{detail}: "
                              "use GPUs with more memory, a shorter --seq-len or a higher --gpus range")
    return found, built


def run_sweep(request, gpu_range: GpuRange, tokens: float | None, price: float | None, as_json: bool,
              output: str | None, png: str | None) -> None:
    """Sweep, print the table (or JSON), and write the smallest fitting count's plan and the chart when asked."""
    from planner.cli.request import with_request
    from planner.search.explain import build_plan

    found, built = sweep_request(request, gpu_range, quiet=as_json)
    best = found.smallest_fit
    fastest = max((p for p in found.points if p.fits), key=lambda p: p.tokens_per_s)
    costs = {p.gpus: training_cost(tokens, p.tokens_per_s, p.gpus, price) for p in found.points if p.fits} \
        if tokens is not None else {}
    model, cluster = built[best.gpus]
    if output:
        with_request(build_plan(model, cluster, best.result, request.engine), request).save(output)
    band = band_for(request.engine, cluster.gpu.name, model.moe is not None)
    if png:
        from planner.charts.scaling import plot_scaling_chart, scaling_chart

        spread = None if band is None else (1.0 - band.p90_abs_error, 1.0 + band.p90_abs_error)
        plot_scaling_chart(scaling_chart(found, f"{model.name} on {cluster.gpu.name} ({cluster.name}): GPU counts",
                                         tokens, price, band=lambda _point: spread), png)
    if as_json:
        emit_json({"model": request.model, "cluster": request.cluster, **found.to_json(),
                   "fastest_gpus": fastest.gpus,
                   "uncertainty": uncertainty_json(request.engine, cluster.gpu.name, model.moe is not None),
                   **({"training_cost": {str(k): v for k, v in costs.items()}} if costs else {})})
        return
    _print_sweep(request, found, costs, output, png,
                 band_words(request.engine, cluster.gpu.name, model.moe is not None))


def _print_sweep(request, found: Sweep, costs: dict, output: str | None, png: str | None, band: str) -> None:
    from rich import box
    from rich.table import Table

    from planner.cli.request import si
    from planner.search.explain import short

    out = console()
    if not out.is_terminal:
        out.width = max(out.width, 120)
    best = found.smallest_fit
    winner = best.result.best
    table = Table(title=f"{request.model} on {request.cluster}: GPU counts", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("GPUs", "fits", "tok/s", "tok/s/GPU", "MFU", "best layout", *(("days",) if costs else ()),
                *(("cost",) if costs and "cost" in next(iter(costs.values())) else ())):
        table.add_column(col, justify="left" if col in ("fits", "best layout") else "right",
                         no_wrap=col != "best layout", overflow="fold")
    for p in found.points:
        if not p.fits:
            miss = p.result.near_miss
            need = f"needs {miss.needed_bytes / 2**30:.0f} GiB" if miss else "no layout"
            table.add_row(str(p.gpus), f"no ({need})", "-", "-", "-", "-", *(["-"] * (len(table.columns) - 6)))
            continue
        r = p.result.best.result
        extra = []
        if costs:
            c = costs[p.gpus]
            extra.append(thousands(c["days"]))
            if "cost" in c:
                extra.append(f"${thousands(c['cost'])}")
        table.add_row(str(p.gpus), "yes", si(p.tokens_per_s), si(p.tokens_per_s_per_gpu), percent(r.mfu),
                      short(p.result.best.layout), *extra)
    out.print(table)
    out.print(f"Predicted step times{band}.")
    out.print(f"Smallest count that fits: {best.gpus} GPUs ({short(winner.layout)})."
              + (f" Ruled out without a search (model state alone exceeds memory): {', '.join(map(str, found.ruled_out))}."
                 if found.ruled_out else ""))
    fits = [p for p in found.points if p.fits]
    efficient = found.recommended
    line = f"Most tokens/s per GPU: {efficient.gpus} GPUs ({thousands(efficient.tokens_per_s_per_gpu)})"
    if costs and "cost" in costs[best.gpus]:
        cheapest = min(fits, key=lambda p: costs[p.gpus]["cost"])
        line += f"; cheapest to train: {cheapest.gpus} GPUs (${thousands(costs[cheapest.gpus]['cost'])})"
    out.print(line + ".")
    if found.stopped_paying_at is not None:
        out.print(f"Scaling stops paying after {found.stopped_paying_at} GPUs: the next doubling gives less than "
                  f"{SCALING_WORTH_IT:.0%} of twice the tokens/s.")
    else:
        out.print(f"Every doubling evaluated up to {fits[-1].gpus} GPUs still pays (at least "
                  f"{SCALING_WORTH_IT:.0%} scaling efficiency); widen the range to look further.")
    if costs:
        out.print(describe_cost(costs[best.gpus]) + f" on {best.gpus} GPUs.")
    out.print(f"[dim]sweep: {len(found.points)} counts searched in {found.elapsed_s:.2f} s[/]")
    if output:
        out.print(f"wrote the plan for {best.gpus} GPUs to {output}")
    if png:
        out.print(f"wrote the scaling chart to {png}")
