"""`plan --gpus auto | LO-HI`: the GPU-count sweep's printing, and "needs at least N GPUs" for a plan that does not fit.

The sweep itself is `planner.search.sweep`; this module runs it through
`planner.cli.plan.search_at` (the same inputs as a one-count plan) and prints
or writes what it found. The best count's plan is what -o and --png get.
"""

from __future__ import annotations

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


def run_sweep(request, gpu_range: GpuRange, tokens: float | None, price: float | None, as_json: bool,
              output: str | None, png: str | None) -> None:
    """Sweep, print the table (or JSON), and write the best count's plan and chart when asked."""
    from planner.cli.request import node_size, plot_plan_memory, search_at, with_search
    from planner.search.explain import build_plan

    counts = allowed_counts(node_size(request), gpu_range.lo, gpu_range.hi)
    if not counts:
        raise UsageError(f"--gpus {gpu_range.lo}-{gpu_range.hi}: no whole-node or power-of-two count of cluster "
                         f"{request.cluster!r} lies in that range; widen it")
    built: dict[int, tuple] = {}

    def at(n: int):
        model, cluster, result = search_at(request, n, top=1)
        built[n] = (model, cluster)
        return result

    found = sweep(counts, at, gpu_range.auto, state_bound=request.pins.offload in (None, "none"))
    best = found.smallest_fit
    if best is None:
        last = found.points[-1] if found.points else None
        miss = last.result.near_miss if last else None
        detail = (f"; at {last.gpus} GPUs the closest layout needs {miss.needed_bytes / 2**30:.1f} GiB per GPU"
                  if last and miss else "")
        raise InfeasibleError(f"no GPU count from {counts[0]} to {counts[-1]} fits {request.model}{detail}: "
                              "use GPUs with more memory, a shorter --seq-len or a higher --gpus range")
    fastest = max((p for p in found.points if p.fits), key=lambda p: p.tokens_per_s)
    costs = {p.gpus: training_cost(tokens, p.tokens_per_s, p.gpus, price) for p in found.points if p.fits} \
        if tokens is not None else {}
    if output or png:
        model, cluster = built[best.gpus]
        the_plan = with_search(build_plan(model, cluster, best.result, request.engine), request)
        if output:
            the_plan.save(output)
        if png:
            plot_plan_memory(the_plan, best.result, png, request.usable_fraction)
    if as_json:
        emit_json({"model": request.model, "cluster": request.cluster, **found.to_json(),
                   "fastest_gpus": fastest.gpus,
                   **({"training_cost": {str(k): v for k, v in costs.items()}} if costs else {})})
        return
    _print_sweep(request, found, costs, output)


def _print_sweep(request, found: Sweep, costs: dict, output: str | None) -> None:
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
            extra.append(f"{c['days']:.1f}")
            if "cost" in c:
                extra.append(f"${c['cost']:,.0f}")
        table.add_row(str(p.gpus), "yes", si(p.tokens_per_s), si(p.tokens_per_s_per_gpu), f"{r.mfu:.1%}",
                      short(p.result.best.layout), *extra)
    out.print(table)
    out.print(f"Smallest count that fits: {best.gpus} GPUs ({short(winner.layout)})."
              + (f" Ruled out without a search (model state alone exceeds memory): {', '.join(map(str, found.ruled_out))}."
                 if found.ruled_out else ""))
    fits = [p for p in found.points if p.fits]
    efficient = max(fits, key=lambda p: p.tokens_per_s_per_gpu)
    line = f"Most tokens/s per GPU: {efficient.gpus} GPUs ({efficient.tokens_per_s_per_gpu:,.0f})"
    if costs and "cost" in costs[best.gpus]:
        cheapest = min(fits, key=lambda p: costs[p.gpus]["cost"])
        line += f"; cheapest to train: {cheapest.gpus} GPUs (${costs[cheapest.gpus]['cost']:,.0f})"
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
