"""What one `plan` search needs besides the GPU count, so `--gpus auto` can vary it; and the searches around it.

`PlanRequest` holds the flags; `search_at` resolves them for one GPU count
(model, cluster sized, calibration, pins checked) and searches;
`search_plan_request` turns an empty search into its typed error, naming how
many GPUs would fit (`gpus_needed_sentence`, a short sweep upward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from planner.cli.inputs import load_model_arg
from planner.search.candidates import Pins
from topologies.terminal import si  # noqa: F401  (the short numbers of plan's tables)

# "needs at least N GPUs" looks this far past the count asked for (and no further
# than this many seconds), so an infeasible plan answers in a few seconds.
NEEDED_SEARCH_FACTOR = 1024
NEEDED_SEARCH_BUDGET_S = 5.0


class TrainingOptions(NamedTuple):
    """--precision, --attention, --compile, --async-tp: how the model trains, given by the user, never searched."""

    precision: str = "bf16"
    attention: str = ""  # "" = the engine's kernel
    compile: bool = False
    async_tp: bool = False
    recipe: tuple[tuple[str, bool], ...] = ()  # --recipe KEY=VALUE: TrainingSpec's recipe options


def check_training_options(options: TrainingOptions, engine: str, gpu, recompute: str | None) -> None:
    """UsageErrors for options this engine or GPU cannot honour, naming what would."""
    from planner.engines import get_engine
    from topologies.errors import TopologyError, UsageError

    eng = get_engine(engine)
    if options.precision == "bf16" and gpu.kind != "cpu" and gpu.bf16_flops <= 0:
        raise UsageError(f"--precision bf16 (the default): {gpu.name} has no bf16 tensor cores (Turing T4, Volta "
                         "V100); pass --precision fp16 (16-bit weights and activations with dynamic loss scaling, "
                         f"{gpu.fp16_flops / 1e12:g} TFLOP/s on {gpu.name}), or pick a GPU with bf16 (Ampere or later)")
    if options.precision in ("fp8", "mxfp8") and gpu.kind == "cpu":
        raise UsageError(f"--precision {options.precision}: CPU ranks run in fp32 and have no 8-bit matrix units; "
                         "plan fp8 on a GPU cluster that has it (e.g. --cluster dgx-h100), or drop --precision")
    if options.precision in ("fp8", "mxfp8") and gpu.kind != "cpu":
        try:
            gpu.peak_flops(options.precision)
        except TopologyError:
            have = "fp8 (per-tensor scaling)" if gpu.fp8_flops else "no 8-bit tensor cores"
            raise UsageError(f"--precision {options.precision}: {gpu.name} has {have}; mxfp8 needs Blackwell "
                             "(b200, b300, gb200, gb300), fp8 Hopper or later") from None
    if options.compile and not eng.compiles:
        raise UsageError(f"--compile: engine {engine} does not compile blocks with torch.compile; use "
                         "--engine torchtitan or meshplan, or drop --compile")
    if options.async_tp:
        _check_async_tp(options, engine, gpu)
    if recompute is not None and recompute not in eng.recompute_kinds:
        raise UsageError(f"--recompute {recompute}: engine {engine} implements {', '.join(eng.recompute_kinds)}")


def check_recipe(options: TrainingOptions, engine: str, model) -> None:
    """--recipe options the training or the engine refuses (TrainingSpec's and Engine.refusal's rules) as
    UsageErrors, before a search that would refuse every layout."""
    from planner.cli.finetune import check_finetune
    from planner.engines import get_engine
    from planner.layout import Layout
    from planner.training import LORA_FIELDS, training_for
    from topologies.errors import PlanError, UsageError

    lora = {k: v for k, v in options.recipe if k in LORA_FIELDS}
    check_finetune(model, engine, options.precision, lora)
    recipe = {k: v for k, v in options.recipe if k not in LORA_FIELDS}
    if not recipe:
        return
    try:
        training = training_for(1, 1, options.precision, **recipe)
    except PlanError as exc:
        raise UsageError(f"--recipe: {str(exc).removeprefix('training: ')}") from None
    refusal = get_engine(engine).refusal(model, Layout(), training.dtype, True, training)
    if refusal:
        raise UsageError(f"--recipe: {refusal}")


def check_recompute_modules(pins: Pins, engine: str, model) -> None:
    """--recompute-modules the engine or the model cannot run (Engine.refusal's rule) as a UsageError."""
    from planner.engines import get_engine
    from planner.layout import Layout
    from topologies.errors import UsageError

    if not pins.recompute_modules:
        return
    layout = Layout(recompute="selective", recompute_modules=pins.recompute_modules)
    refusal = get_engine(engine).refusal(model, layout, "bf16", True)
    if refusal:
        raise UsageError(f"--recompute-modules: {refusal}")


def _check_async_tp(options: TrainingOptions, engine: str, gpu) -> None:
    """--async-tp exists in torchtitan (an Inductor pass, so --compile) and Megatron-Core (TE userbuffers)."""
    from planner.engines import ENGINE_NAMES, get_engine, newest
    from topologies.errors import UsageError

    eng = get_engine(engine)
    have = ", ".join(f"{name} ({newest(name).async_tp_option})" for name in ENGINE_NAMES
                     if newest(name).async_tp_option)
    if not eng.async_tp_option:
        raise UsageError(f"--async-tp: engine {engine} has no option that overlaps TP communication with its GEMMs; "
                         f"engines that have one: {have}. Use one of them or drop --async-tp")
    if gpu.kind == "cpu":
        raise UsageError("--async-tp: CPU ranks have no symmetric memory or userbuffers to pipeline TP collectives "
                         "with; plan it on a GPU cluster (e.g. --cluster dgx-h100) or drop --async-tp")
    if eng.async_tp_needs_compile and not options.compile:
        raise UsageError(f"--async-tp: engine {engine} runs async TP as a torch.compile (Inductor) pass; "
                         "add --compile")


def check_async_tp_pins(options: TrainingOptions, pins: Pins) -> None:
    """--async-tp with --tp 1 or --no-sequence-parallel pinned can never hold: say so before searching."""
    from topologies.errors import UsageError

    if options.async_tp and (pins.tp == 1 or pins.sequence_parallel is False):
        pinned = "--tp 1" if pins.tp == 1 else "--no-sequence-parallel"
        raise UsageError(f"--async-tp with {pinned}: async TP pipelines sequence parallelism's all-gathers and "
                         "reduce-scatters, so it needs tp > 1 with sequence parallel; drop one of the two")


@dataclass(frozen=True)
class PlanRequest:
    """Everything `plan` searches with except the GPU count (so a sweep can vary it)."""

    model: str
    cluster: str
    overrides: tuple[str, ...]
    seq_len: int | None
    global_batch: int | None
    pins: Pins
    engine: str
    calibration: str | None
    top: int
    usable_fraction: float
    options: TrainingOptions = TrainingOptions()
    allow_long_context: bool = False  # --allow-long-context: a --seq-len past the native context is the user's call


def search_at(request: PlanRequest, gpus: int, top: int | None = None):
    """(model, cluster, SearchResult) for `request` on `gpus` GPUs; the result may hold no layout."""
    from planner.model.context import check_context
    from planner.search.candidates import check_pins
    from planner.search.search import search
    from planner.simulate.calibration import load_calibration
    from planner.training import default_seq_len
    from topologies.cluster_load import load_cluster, parse_overrides

    model = load_model_arg(request.model)
    cluster = load_cluster(request.cluster, gpus, parse_overrides(request.overrides))
    seq = request.seq_len or default_seq_len(model.max_seq_len)
    check_context(model, seq, request.allow_long_context)
    profile = load_calibration(request.calibration, cluster.gpu)
    check_pins(cluster.world_size, model, seq, request.global_batch, request.pins)
    options = request.options
    check_training_options(options, request.engine, cluster.gpu, request.pins.recompute)
    check_recipe(options, request.engine, model)
    check_async_tp_pins(options, request.pins)
    check_recompute_modules(request.pins, request.engine, model)
    result = search(model, cluster, seq, request.global_batch, request.pins, request.engine, profile,
                    top or request.top, request.usable_fraction, precision=options.precision,
                    attention=options.attention, compile=options.compile, async_tp=options.async_tp,
                    recipe=dict(options.recipe))
    return model, cluster, result


def search_plan_request(request: PlanRequest, gpus: int, quiet: bool = False):
    """(Plan, SearchResult) on `gpus` GPUs; InfeasibleError naming how many GPUs would fit when none does
    (a search of a few seconds at most, with a progress line on a terminal unless `quiet`)."""
    from planner.search.explain import build_plan, no_layout_error
    from topologies.errors import InfeasibleError

    model, cluster, result = search_at(request, gpus)
    if not result.ranked:
        error = no_layout_error(result, request.pins, cluster.world_size, request.engine)
        if isinstance(error, InfeasibleError):
            error = InfeasibleError(f"{error}{gpus_needed_sentence(request, cluster, quiet)}")
        raise error
    return with_request(build_plan(model, cluster, result, request.engine), request), result


def with_request(the_plan, request: PlanRequest):
    """The plan with what this request knows beyond the layout: plan.json's `weights_dir` (where --model's
    safetensors are, when it named a Hugging Face directory) and its "search" record (pins, memory fraction,
    calibration; read by execute --replan)."""
    import dataclasses

    from planner.model.load import weights_dir

    return dataclasses.replace(the_plan, weights_dir=weights_dir(request.model) or the_plan.weights_dir,
                               search={"pins": request.pins.to_json(),
                                       "usable_memory_fraction": request.usable_fraction,
                                       "calibration": request.calibration})


def node_size(request) -> int:
    from topologies.cluster_load import load_cluster, parse_overrides

    return load_cluster(request.cluster, None, parse_overrides(request.overrides)).gpus_per_node


def gpus_needed_sentence(request, cluster, quiet: bool = False) -> str:
    """'; needs at least N GPUs of CLUSTER' from a short sweep above the count asked for ('' if none found)."""
    from planner.search.sweep import AUTO_MAX_GPUS, allowed_counts, sweep
    from topologies.terminal import Progress

    n = cluster.world_size
    counts = allowed_counts(node_size(request), n + 1, min(AUTO_MAX_GPUS, n * NEEDED_SEARCH_FACTOR))
    with Progress(f"nothing fits on {n} GPUs; looking for a count that does", quiet=quiet) as bar:
        def at(count: int):
            bar.describe(f"{count} GPUs")
            return search_at(request, count, top=1)[2]

        found = sweep(counts, at, auto=True, state_bound=request.pins.offload in (None, "none"), max_fits=1,
                      budget_s=NEEDED_SEARCH_BUDGET_S)
    fit = found.smallest_fit
    if fit is None:
        return ""
    return f"; needs at least {fit.gpus} GPUs of {cluster.name} with these settings (`--gpus auto` shows how it scales)"


def plot_plan_memory(the_plan, result, png: str, usable_fraction: float) -> None:
    """The plan's memory picture: the chosen layout by pipeline stage, then the ranked layouts' worst ranks,
    against the GPU's memory and the planning limit."""
    from planner.charts.memory import MemoryChart, plot_memory_chart, ranked_panel, stage_panel
    from planner.search.explain import short

    c = the_plan.cluster
    best = result.ranked[0]
    panels = (stage_panel(best.result.memory, best.layout, f"#1 {short(best.layout)}, by pipeline stage"),
              ranked_panel(result.ranked, short))
    plot_memory_chart(MemoryChart(f"{the_plan.model.name} on {c.world_size} x {c.gpu.name} ({c.name}): memory per GPU",
                                  panels, c.gpu.memory_bytes, int(c.gpu.memory_bytes * usable_fraction)), png)
