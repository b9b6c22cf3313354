"""`meshplan plan` and `meshplan compare`: thin click layers over planner.search.search and planner.search.compare.

Nothing here imports torch; rich and matplotlib are imported only when a
table or a chart is drawn, so `plan` answers in well under two seconds.
"""

from __future__ import annotations

import click

from planner.cli.finetune import check_finetune, finetune_fields, finetune_options
from planner.cli.inputs import FiniteFloat, config_option, load_model_arg, resolve_model_arg
from planner.cli.request import PlanRequest, TrainingOptions, plot_plan_memory, search_plan_request, si
from planner.engines import ENGINE_CHOICES, releases_help
from planner.figures import percent, sig
from planner.layout import PP_SCHEDULES, RECOMPUTE_KINDS, RECOMPUTE_MODULES, recompute_label
from planner.search.candidates import Pins
from planner.training import ATTENTION_KINDS, PRECISIONS, RECIPE_KEYS, parse_recipe
from topologies.errors import InfeasibleError, UsageError
from topologies.terminal import console, emit_json

POSITIVE = click.IntRange(min=1)
OFFLOAD_CHOICES = ("none", "optimizer", "params", "auto")
SCHEDULE_SHORT = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "int", "zb-v": "zb-v", "dualpipev": "dpv"}


def parse_recompute_modules(text: str | None) -> tuple[str, ...] | None:
    """--recompute-modules core_attn,moe_act -> ("core_attn", "moe_act"); Pins checks the names."""
    if text is None:
        return None
    return tuple(part.strip() for part in text.split(",") if part.strip())


def plan_request(params: dict) -> PlanRequest:
    """The PlanRequest of `plan`'s parsed flags (also what a row's flags mean: planner.cli.row)."""
    from planner.cli.inputs import headroom_fraction

    p = params
    modules = parse_recompute_modules(p["recompute_modules"])
    recompute = p["recompute"]
    if modules is not None and recompute is None:  # as Megatron-Bridge: naming modules selects "selective"
        recompute = "selective"
    pins = Pins(tp=p["tp"], pp=p["pp"], dp=p["dp"], dp_shard=p["dp_shard"], cp=p["cp"], zero_stage=p["zero"],
                micro_batch_size=p["micro_batch"], recompute=recompute, sequence_parallel=p["sequence_parallel"],
                pp_schedule=p["pp_schedule"], virtual_stages=p["virtual_stages"], ep=p["ep"], etp=p["etp"],
                recompute_modules=modules, layers_per_stage=parse_counts(p["layers_per_stage"], "--layers-per-stage"),
                activation_offload_layers=p["activation_offload_layers"], offload=offload_pin(p.get("offload")))
    options = TrainingOptions(p["precision"], p["attention"] or "", p["compile_"], p["async_tp"],
                              tuple(parse_recipe(p["recipe"]).items()) + tuple(finetune_fields(p).items()))
    return PlanRequest(p["model"], p["cluster"], tuple(p["overrides"]), p["seq_len"], p["global_batch"], pins,
                       p["engine"], p["calibration"], p["top"], headroom_fraction(p["headroom_pct"]), options,
                       p.get("allow_long_context", False))


def offload_pin(name: str | None) -> str | None:
    """--offload VALUE -> Pins.offload: "params" is Layout.offload "optimizer+params"; auto stays auto."""
    from planner.simulate.offload import offload_kind

    return None if name is None else name if name == "auto" else offload_kind(name)


OFFLOAD_SHORT = {"none": "-", "optimizer": "opt", "optimizer+params": "params"}


def offload_words(summary: dict | None) -> str:
    """One line on an offloading layout's host: its memory, the bytes its link moves, the host's step."""
    if not summary:
        return ""
    gib, gb = 2**30, 1e9
    return (f"Host ({summary['kind']} offloaded): {summary['host_memory_per_node_bytes'] / gib:.1f} GiB of "
            f"{summary['host_memory_capacity_bytes'] / gib:.0f} usable per node; per GPU and step "
            f"{sig(summary['down_bytes'] / gb)} GB down and {sig(summary['up_bytes'] / gb)} GB up its "
            f"{summary['host_link']} ({sig(summary['host_link_gbytes_per_s'])} GB/s per direction, shared), "
            f"optimizer step on the host {sig(summary['host_optimizer_s'])} s"
            + (f", then {sig(summary['parameter_upload_s'])} s to copy the weights back"
               if summary["parameter_upload_s"] else "") + ".")


def parse_counts(text: str | None, flag: str) -> tuple[int, ...] | None:
    """"7,8,8,7" -> (7, 8, 8, 7); a UsageError naming the flag otherwise."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected integers separated by commas, e.g. 7,8,8,7") from None


def _common(f):
    """Options shared by plan and compare (model, batch, engine, calibration)."""
    for decorator in reversed([
        config_option,
        click.option("--model", required=True,
                     help="Preset name, size alias (13B), config.json path or Hugging Face snapshot directory."),
        click.option("--gpus", required=True, metavar="N|LO-HI|auto",
                     help="Number of GPUs (whole nodes beyond the first); `plan` also takes a range (8-512) or "
                          "auto, to sweep the counts the cluster allows."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override a cluster field, e.g. --set nic_gbit_per_s=200 (repeatable)."),
        click.option("--seq-len", type=POSITIVE, default=None,
                     help="Tokens per sequence. Default: the model's native context, at most 4096."),
        click.option("--allow-long-context", "allow_long_context", is_flag=True,
                     help="Plan a --seq-len beyond the model's native context (max_position_embeddings): you extend "
                          "its positions yourself (rope_scaling, rope_theta). Refused without it."),
        click.option("--global-batch", type=POSITIVE, default=None,
                     help="Sequences per optimizer step. Default: about 1M tokens (2^20 / seq-len), rounded to a "
                          "multiple of each layout's data-parallel degree (within 25%)."),
        click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="meshplan", show_default=True,
                     metavar="NAME[@RELEASE]",
                     help="The training stack whose step the prediction models, at a release (a bare name is "
                          f"its newest): {releases_help()}."),
        click.option("--precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True,
                     help="How block GEMMs run: bf16/fp16/fp32, or fp8 (per-tensor scaling) / mxfp8 (block scaling, "
                          "Blackwell) around a bf16 model. GPUs without bf16 (T4, V100): fp16."),
        finetune_options,
        click.option("--calibration", type=click.Path(dir_okay=False), default=None,
                     help="Calibration profile JSON (default: the shipped profile of the cluster's GPU)."),
        click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default=None,
                     help="Model state in pinned host memory: optimizer (fp32 weights and Adam moments, the step on "
                          "the host), params (the parameters too: FSDP2 CPUOffloadPolicy, DeepSpeed offload_param), "
                          "auto (searched). Priced by the host link, the host's optimizer step and its RAM (cluster "
                          "keys host_memory_gib, host_memory_gbytes_per_s, host_cores). Default: none."),
        click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout."),
    ]):
        f = decorator(f)
    return f


@click.command(epilog="\b\nExamples:\n  meshplan plan --model 70B --gpus 64\n  meshplan plan --model 405B --gpus auto --tokens 15T --price-per-gpu-hour 2.5\n  meshplan plan --model ./Llama-3.1-8B --gpus 8-64 --memory-headroom 10\n  meshplan plan --config job.toml -o plan.json --png memory.png\n")
@click.option("--cluster", default="dgx-h100", show_default=True, help="Cluster preset name or TOML path.")
@_common
@click.option("--tp", type=POSITIVE, default=None, help="Pin the tensor-parallel degree.")
@click.option("--pp", type=POSITIVE, default=None, help="Pin the number of pipeline stages.")
@click.option("--dp", type=POSITIVE, default=None, help="Pin the total data-parallel degree (dp_replicate x dp_shard).")
@click.option("--dp-shard", type=POSITIVE, default=None, help="Pin the ZeRO/FSDP sharding degree.")
@click.option("--cp", type=POSITIVE, default=None, help="Pin the context-parallel degree.")
@click.option("--zero", type=click.IntRange(0, 3), default=None, help="Pin the ZeRO stage (0: DDP, dp_shard 1).")
@click.option("--micro-batch", type=POSITIVE, default=None, help="Pin the micro-batch size (sequences).")
@click.option("--sequence-parallel/--no-sequence-parallel", default=None,
              help="Pin sequence parallelism (default: both are searched when tp > 1).")
@click.option("--pp-schedule", type=click.Choice(PP_SCHEDULES), default=None, help="Pin the pipeline schedule.")
@click.option("--virtual-stages", type=POSITIVE, default=None, help="Pin model chunks per pipeline rank.")
@click.option("--ep", type=POSITIVE, default=None, help="Pin the expert-parallel degree (MoE; within dp_shard x cp x tp).")
@click.option("--layers-per-stage", "layers_per_stage", default=None, metavar="N,N,...",
              help="Pin the layers of each pipeline chunk (pp x virtual stages counts, e.g. Megatron's split with "
                   "fewer layers on the first and last chunks). Default: balanced.")
@click.option("--activation-offload-layers", "activation_offload_layers", type=click.IntRange(min=0), default=None,
              help="Layers per chunk whose activations wait in host memory (Megatron-Core's "
                   "cpu_offloading_num_layers; --engine megatron). Default: 0.")
@click.option("--etp", type=POSITIVE, default=None, help="Pin the expert tensor-parallel degree (MoE; default 1 or tp).")
# ---- how the model trains (precision is given, never searched; recompute is searched unless pinned)
@click.option("--recompute", type=click.Choice(RECOMPUTE_KINDS), default=None,
              help="Pin activation recomputation: selective = attention core (Megatron), op = per-op "
                   "selective checkpointing (torchtitan), full = whole blocks. Default: searched.")
@click.option("--recompute-modules", "recompute_modules", default=None, metavar="MODULE,...",
              help="Megatron-Core's selective recomputation modules (--engine megatron): "
                   f"{', '.join(RECOMPUTE_MODULES)}; implies --recompute selective. Default: core_attn.")
@click.option("--attention", type=click.Choice(ATTENTION_KINDS), default=None,
              help="Attention kernel: fused (flash/cuDNN) or eager (softmax over materialized scores). "
                   "Default: the engine's.")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile per block (torchtitan, meshplan).")
@click.option("--async-tp", "async_tp", is_flag=True,
              help="Pipeline TP's sequence-parallel all-gathers/reduce-scatters with their GEMMs: torchtitan "
                   "enable_async_tensor_parallel (needs --compile), megatron --tp-comm-overlap.")
@click.option("--recipe", "recipe", multiple=True, metavar="KEY=VALUE",
              help="A recipe option of the training stack, given, not searched (repeatable; plan.json training "
                   f"keys): {', '.join(RECIPE_KEYS)}; true or false, optimizer_dtype fp32, bf16 or fp16.")
# ----
@click.option("--top", type=click.IntRange(1, 50), default=5, show_default=True, help="Layouts to rank.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write plan.json here.")
@click.option("--png", type=click.Path(dir_okay=False), default=None,
              help="Write a chart: memory per GPU by category for the chosen layout's pipeline stages and the "
                   "ranked layouts; with --gpus auto or a range, tokens/s, days and cost against the GPU count.")
# How many GPUs, how long, how much (planner.search.sweep), and how much memory to leave free.
@click.option("--memory-headroom", "headroom_pct", type=FiniteFloat(0, 90), default=None, metavar="PCT",
              help="Percent of GPU memory a plan leaves free [default: 5].")
@click.option("--tokens", default=None, metavar="COUNT",
              help="Training tokens (15T, 300B): print the time (and with a price, the cost) to train.")
@click.option("--price-per-gpu-hour", "price", type=FiniteFloat(0), default=None, metavar="PRICE",
              help="Price of one GPU-hour, for the cost of --tokens.")
def plan(cluster, model, gpus, overrides, seq_len, allow_long_context, global_batch, engine, finetune, lora_rank,
         lora_alpha, lora_targets, calibration, offload, as_json, tp, pp, dp,
         dp_shard, cp, zero, micro_batch, sequence_parallel, pp_schedule, virtual_stages, ep, layers_per_stage,
         activation_offload_layers, etp, precision, recompute, recompute_modules, attention, compile_, async_tp,
         recipe, top, output, png, headroom_pct, tokens, price):
    """Find the fastest layout (DP/TP/PP/CP/ZeRO, micro-batch, recompute, schedule) that fits memory.

    Any layout flag pins that option; the search fills in the rest. Exit code
    3 when no layout fits, with the smallest shortfall, how many GPUs would
    fit, and what else would fix it. `--gpus auto` or a range answers how many
    GPUs to use instead.
    """
    from planner.search.sweep import parse_gpus, parse_tokens
    from topologies.files import check_output

    check_output(output, "-o")
    check_output(png, "--png", image=True)
    gpu_range = parse_gpus(gpus)
    train_tokens = parse_tokens(tokens) if tokens is not None else None
    request = plan_request(click.get_current_context().params)
    try:
        if gpu_range.is_sweep:
            from planner.cli.sweep import run_sweep

            run_sweep(request, gpu_range, train_tokens, price, as_json, output, png)
            return
        the_plan, result = search_plan_request(request, gpu_range.lo, quiet=as_json)
    except InfeasibleError as exc:
        if as_json:  # a script reading stdout gets an answer too, not an empty string
            emit_json({"feasible": False, "error": str(exc), "exit_code": exc.exit_code})
        raise
    if output:
        the_plan.save(output)
    if png:
        plot_plan_memory(the_plan, result, png, request.usable_fraction)
    cost = None
    if train_tokens is not None:
        from planner.search.sweep import training_cost

        cost = training_cost(train_tokens, result.best.result.tokens_per_s, the_plan.cluster.world_size, price)
    if as_json:
        emit_json({**the_plan.to_json(), **({"training_cost": cost} if cost else {})})
        return
    _print_plan(the_plan, result, output, png)
    if cost:
        from planner.search.sweep import describe_cost

        console().print(describe_cost(cost))


@click.command(epilog="\b\nExamples:\n  meshplan compare --model 70B --gpus 64 --cluster dgx-h100,dgx-a100-80g\n  meshplan compare --model 8B --gpus 16 --what-if nic_gbit_per_s=100,200,400 --png nic.png\n  meshplan compare --model 70B --gpus 64 --cluster dgx-h100,dgx-b200 --price-per-gpu-hour 2.5,4\n")
@click.option("--cluster", "clusters", default="dgx-h100", show_default=True,
              help="Comma-separated cluster presets or TOML paths, compared side by side.")
@_common
@click.option("--what-if", "what_if", multiple=True, metavar="KEY=V1,V2,...",
              help="Vary a cluster field (any --set key) or seq_len / global_batch / gpus (repeatable).")
@click.option("--price-per-gpu-hour", default=None, metavar="P[,P2,...]",
              help="Price of one GPU-hour, for the cost per million tokens: one for all variants, or one per variant.")
@click.option("--png", type=click.Path(dir_okay=False), default=None,
              help="Write a bar chart of tokens/s (and cost) per variant.")
def compare(clusters, model, gpus, overrides, seq_len, allow_long_context, global_batch, engine, precision,
            finetune, lora_rank, lora_alpha, lora_targets, calibration, offload, as_json, what_if, price_per_gpu_hour,
            png):
    """Best layout per cluster or what-if variant, side by side: speed-up vs the first, MFU, cost."""
    from planner.search.compare import compare_variants, plot_compare, print_compare
    from planner.search.sweep import parse_gpus
    from topologies.files import check_output

    check_output(png, "--png", image=True)
    gpu_range = parse_gpus(gpus)
    if gpu_range.is_sweep:
        raise UsageError(f"compare --gpus {gpus!r}: compare takes one GPU count; sweep counts with "
                         f"`meshplan plan --gpus {gpus}`")
    gpus = gpu_range.lo
    model = resolve_model_arg(model)
    spec = load_model_arg(model)  # a malformed file fails here, as one line, before any variant is searched
    check_finetune(spec, engine, precision, finetune_fields(click.get_current_context().params))
    from topologies.terminal import Progress

    with Progress("compare", unit="variants", quiet=as_json) as bar:
        rows = compare_variants(model, gpus, clusters, overrides, what_if, seq_len, global_batch, engine, calibration,
                                price_per_gpu_hour, precision=precision,
                                allow_long_context=allow_long_context, progress=bar, offload=offload_pin(offload),
                                finetune=finetune_fields(click.get_current_context().params))
    if png:
        plot_compare(rows, png, title=f"{model} on {gpus} GPUs: {len(rows)} variant{'s' if len(rows) != 1 else ''}")
    if as_json:
        emit_json({"model": model, "gpus": gpus, "variants": [r.to_json() for r in rows]})
        return
    print_compare(rows, console(), png)


def search_plan(model_name: str, cluster_name: str, gpus: int, overrides: tuple[str, ...], seq_len: int | None,
                global_batch: int | None, pins: Pins, engine: str, calibration: str | None, top: int,
                options: TrainingOptions = TrainingOptions()):
    """Resolve the inputs, search, and return (Plan, SearchResult); typed errors when nothing can run."""
    from planner.search.search import USABLE_MEMORY_FRACTION

    request = PlanRequest(model_name, cluster_name, tuple(overrides), seq_len, global_batch, pins, engine,
                          calibration, top, USABLE_MEMORY_FRACTION, options)
    return search_plan_request(request, gpus)


def _print_plan(the_plan, result, output: str | None, png: str | None) -> None:
    """The human view: a table of the best layouts and the explanation."""
    from rich import box
    from rich.table import Table

    out = console()
    if not out.is_terminal:  # a pipe or file has no width to respect: do not squeeze the table
        out.width = max(out.width, 120)
    m, c, t = the_plan.model, the_plan.cluster, the_plan.training
    out.print(f"[bold]{m.name}[/] ({si(m.total_params)} params) on {c.world_size} x {c.gpu.name} "
              f"({c.name}, {c.n_nodes} node{'s' if c.n_nodes > 1 else ''}); seq {t.seq_len}, "
              f"global batch {t.global_batch_size} ({si(t.tokens_per_step)} tokens), engine {the_plan.engine}, "
              f"{t.precision}, {t.attention} attention{', compiled' if t.compile else ''}"
              f"{', async TP' if t.async_tp else ''}"
              + (f", {'QLoRA' if t.finetune == 'qlora' else 'LoRA'} rank {t.lora_rank} "
                 f"alpha {t.lora_alpha:g} on {','.join(t.lora_targets)}" if t.lora else ""))
    table = Table(title=f"best {len(result.ranked)} layouts", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    with_cp = any(x.layout.cp > 1 for x in result.ranked)
    with_offload = any(x.layout.offload != "none" for x in result.ranked)
    for col in ("tp", "pp", "dp", *(("cp",) if with_cp else ()), "ZeRO", *(("offload",) if with_offload else ()),
                "mb x acc", "recomp", "sched", "step s", "tok/s", "MFU", "GiB"):
        table.add_column(col, justify="left" if col in ("recomp", "sched") else "right", no_wrap=True)
    for s in result.ranked:
        lay, r = s.layout, s.result
        dp = str(lay.dp) if not lay.hsdp else f"{lay.dp_replicate}x{lay.dp_shard}"
        sched = "-" if lay.pp == 1 else SCHEDULE_SHORT[lay.pp_schedule] + (
            f"v{lay.virtual_stages}" if lay.pp_schedule == "interleaved-1f1b" else "")
        table.add_row(f"{lay.tp}{'sp' if lay.sequence_parallel else ''}", str(lay.pp), dp,
                      *((str(lay.cp),) if with_cp else ()), str(lay.zero_stage),
                      *((OFFLOAD_SHORT[lay.offload],) if with_offload else ()),
                      f"{lay.micro_batch_size}x{lay.grad_accum_steps}", recompute_label(lay), sched,
                      sig(r.step_time_s), si(r.tokens_per_s), percent(r.mfu), sig(r.memory.peak_bytes / 2**30))
    out.print(table)
    for sentence in the_plan.explanation:
        out.print(sentence)
    host = offload_words(result.best.result.offload)
    if host:
        out.print(host)
    s = result.stats
    out.print(f"[dim]search: {s.shapes} shapes, {s.candidates} candidates, {s.memory_checks} memory checks, "
              f"{s.simulated} simulated in {s.elapsed_s:.2f} s[/]")
    for path, what in ((output, "plan"), (png, "memory chart")):
        if path:
            out.print(f"wrote {what} to {path}")
