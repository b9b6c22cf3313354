"""A published run as data: a row file says what ran as `meshplan plan` flags, and what it measured.

A row (bench/rows/SOURCE/ID.json, format `ROW_VERSION`) holds

  id, source       the run and where it was published: {"name", "citation", "url", "copy"}
  plan             the `meshplan plan` flags that state the run: --model, --cluster, --gpus,
                   --engine NAME@RELEASE, --seq-len, --global-batch, the layout flags, --precision,
                   --recompute..., --recipe KEY=VALUE; paths in them are relative to the row file.
                   null when the run cannot be stated (then `not_expressible` says why)
  measured         what the source measured: step_time_s, and where given peak_memory_gib
  notes            what the source leaves unstated and how the flags fill it
  bench            how a bench groups the row (split, family, ...): never read to predict it

`row_plan` turns the flags into a Plan exactly as `plan` reads them. When they pin
the whole layout (tp, pp, dp, dp-shard unless ZeRO-0, cp, zero, micro-batch,
recompute, sequence parallelism under TP, the schedule under PP, ep and etp for
MoE, the global batch) that layout is simulated as it is, whether or not it fits
the memory model (the run ran); otherwise `plan`'s search fills in the rest and
its best layout is the prediction (a source that gives no micro-batch). Every
accuracy bench predicts its rows through `simulate_row`, the call behind
`meshplan simulate ROW.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.layout import V_SCHEDULES
from topologies.errors import MeshplanError, UsageError

ROW_VERSION = 1


@dataclass(frozen=True)
class Row:
    """One published run, read from its row file."""

    path: Path
    id: str
    source: dict[str, Any]
    flags: tuple[str, ...] | None  # None: not expressible
    measured: dict[str, float]
    not_expressible: str = ""
    notes: tuple[str, ...] = ()
    bench: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def expressible(self) -> bool:
        return self.flags is not None

    @property
    def measured_s(self) -> float:
        return float(self.measured["step_time_s"])

    @property
    def plan(self):
        """The run as a Plan (a search's best when the flags leave part of the layout open)."""
        return _cached_plan(self)[0]


def is_row(data: Any) -> bool:
    """A row document (as opposed to a plan.json)."""
    return isinstance(data, dict) and "row_version" in data


def load_row(path: str | Path) -> Row:
    """The row in `path`; a UsageError naming the file and the key when it is malformed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"row file {str(path)!r} cannot be read as JSON: {exc}") from None
    return row_from_json(data, path)


def row_from_json(data: Any, path: Path) -> Row:
    if not is_row(data):
        raise UsageError(f"row file {str(path)!r} has no row_version: a row holds row_version, id, source, plan "
                         "(meshplan plan flags) and measured")
    if data["row_version"] != ROW_VERSION:
        raise UsageError(f"row file {str(path)!r} has row_version {data['row_version']!r}; this meshplan reads "
                         f"{ROW_VERSION}")
    flags = data.get("plan")
    if flags is not None and not (isinstance(flags, list) and all(isinstance(f, str) for f in flags)):
        raise UsageError(f"row file {str(path)!r}: plan must be a list of `meshplan plan` flags (strings) or null")
    measured = data.get("measured")
    if not isinstance(measured, dict) or not isinstance(measured.get("step_time_s"), (int, float)):
        raise UsageError(f"row file {str(path)!r}: measured must hold step_time_s (seconds per step)")
    if flags is None and not data.get("not_expressible"):
        raise UsageError(f"row file {str(path)!r}: plan is null but not_expressible does not say why")
    return Row(path, str(data.get("id") or path.stem), dict(data.get("source") or {}),
               tuple(flags) if flags is not None else None, dict(measured), str(data.get("not_expressible") or ""),
               tuple(data.get("notes") or ()), dict(data.get("bench") or {}))


def load_rows(folder: str | Path) -> list[Row]:
    """Every row file under `folder` (recursively), in path order."""
    return [load_row(p) for p in sorted(Path(folder).rglob("*.json")) if p.parent.name != "models"]


def _resolve(value: str | None, base: Path) -> str | None:
    """A path in a row's flags, relative to the row file (presets and names are left as they are)."""
    if value is None or not (value.endswith((".json", ".toml", ".yaml", ".yml")) or "/" in value):
        return value
    path = Path(value)
    return value if path.is_absolute() else str((base / path).resolve())


def _request(row: Row, extra: tuple[str, ...]):
    """(PlanRequest, GPU count) from the row's flags, parsed by `plan` itself."""
    import click

    from planner.cli.plan import plan as plan_command
    from planner.cli.plan import plan_request
    from planner.search.sweep import parse_gpus

    if row.flags is None:
        raise UsageError(f"is not expressible: {row.not_expressible}")
    try:
        ctx = plan_command.make_context("plan", [*row.flags, *extra])
    except click.ClickException as exc:
        raise UsageError(f"its flags are not valid `meshplan plan` flags: {exc.format_message()}") from None
    params = dict(ctx.params)
    base = row.path.parent
    for key in ("model", "cluster", "calibration"):
        params[key] = _resolve(params[key], base)
    gpus = parse_gpus(params["gpus"])
    if gpus.is_sweep:
        raise UsageError(f"--gpus must be one count, got {params['gpus']!r}")
    return plan_request(params), gpus.lo


def _pinned_layout(request, model, cluster, training):
    """The Layout the flags pin completely, or None when part of it is left to the search."""
    from planner.layout import Layout, balanced_layers

    p = request.pins
    needed = {"--tp": p.tp, "--pp": p.pp, "--dp": p.dp, "--cp": p.cp, "--zero": p.zero_stage,
              "--micro-batch": p.micro_batch_size, "--recompute": p.recompute, "--global-batch": request.global_batch}
    if p.zero_stage not in (None, 0):
        needed["--dp-shard"] = p.dp_shard
    if (p.tp or 1) > 1:
        needed["--[no-]sequence-parallel"] = p.sequence_parallel
    if (p.pp or 1) > 1:
        needed["--pp-schedule"] = p.pp_schedule
    if model.moe is not None:
        needed.update({"--ep": p.ep, "--etp": p.etp})
    if any(v is None for v in needed.values()):
        return None
    shard = p.dp_shard if p.zero_stage else 1
    v = p.virtual_stages or (2 if p.pp_schedule in V_SCHEDULES else 1)
    lps = p.layers_per_stage or (balanced_layers(model.n_layers, p.pp * v) if p.pp * v <= model.n_layers else ())
    return Layout(tp=p.tp, pp=p.pp, dp_replicate=p.dp // shard, dp_shard=shard, cp=p.cp, ep=p.ep or 1,
                  etp=p.etp or 1, zero_stage=p.zero_stage, micro_batch_size=p.micro_batch_size,
                  grad_accum_steps=training.global_batch_size // (p.dp * p.micro_batch_size),
                  recompute=p.recompute, sequence_parallel=bool(p.sequence_parallel),
                  pp_schedule=p.pp_schedule or "1f1b", virtual_stages=v, layers_per_stage=lps,
                  activation_offload_layers=p.activation_offload_layers or 0,
                  recompute_modules=p.recompute_modules or ())


def row_plan(row: Row, extra: tuple[str, ...] = ()):
    """(Plan, calibration) of the row's flags (plus `extra` flags, e.g. a what-if --set), checked as `plan`
    checks them; the Plan carries no prediction. Errors name the row and its file and keep their type (a row
    whose pins leave no feasible layout is exit code 3, as `plan` would say)."""
    try:
        return _row_plan(row, extra)
    except MeshplanError as exc:
        raise type(exc)(f"row {row.id} ({row.path}): {exc}") from None


def _row_plan(row: Row, extra: tuple[str, ...]):
    from planner.cli.inputs import load_model_arg
    from planner.cli.request import (
        check_async_tp_pins,
        check_recipe,
        check_recompute_modules,
        check_training_options,
    )
    from planner.engines import get_engine
    from planner.plan import Plan, validate
    from planner.search.candidates import check_pins
    from planner.simulate.calibration import load_calibration
    from planner.training import TrainingSpec, default_seq_len
    from topologies.cluster_load import load_cluster, parse_overrides

    request, gpus = _request(row, extra)
    model = load_model_arg(request.model)
    cluster = load_cluster(request.cluster, gpus, parse_overrides(request.overrides))
    seq = request.seq_len or default_seq_len(model.max_seq_len)
    calibration = load_calibration(request.calibration, cluster.gpu)
    options = request.options
    check_pins(cluster.world_size, model, seq, request.global_batch, request.pins)
    check_training_options(options, request.engine, cluster.gpu, request.pins.recompute)
    check_recipe(options, request.engine, model)
    check_async_tp_pins(options, request.pins)
    check_recompute_modules(request.pins, request.engine, model)
    engine = get_engine(request.engine)
    on_gpu = cluster.gpu.kind != "cpu"  # as the search builds its TrainingSpec (planner.search.search._Context)
    dtype = options.precision if options.precision in ("fp16", "fp32") else "bf16" if on_gpu else "fp32"
    training = None
    if request.global_batch is not None:
        training = TrainingSpec(seq_len=seq, global_batch_size=request.global_batch, dtype=dtype,
                                precision=options.precision if on_gpu else "fp32",
                                attention=options.attention or engine.attention, compile=options.compile,
                                async_tp=options.async_tp, **dict(options.recipe))
    layout = _pinned_layout(request, model, cluster, training) if training is not None else None
    if layout is None:  # part of the layout is left to plan's search
        from planner.cli.request import search_plan_request

        return search_plan_request(request, gpus)[0], calibration
    validate(model, cluster, training, layout)
    refusal = engine.refusal(model, layout, dtype, on_gpu, training) or engine.microbatch_refusal(layout)
    if refusal:
        raise UsageError(refusal)
    return Plan(model=model, cluster=cluster, training=training, layout=layout, engine=request.engine), calibration


def simulate_row(row: Row, calibration=None, extra: tuple[str, ...] = (), events: bool = False):
    """The row's predicted step (planner.simulate.step.StepResult) on `calibration` (default: the row's
    --calibration, else the GPU's shipped profile). `extra` flags rebuild the plan (a what-if)."""
    from planner.simulate.step import simulate_step

    if extra:
        plan, shipped = row_plan(row, extra)
    else:
        plan, shipped = _cached_plan(row)
    return simulate_step(plan.model, plan.training, plan.layout, plan.cluster, calibration or shipped,
                         engine=plan.engine, events=events)


_PLANS: dict[tuple[str, tuple[str, ...] | None], tuple] = {}


def forget_plans() -> None:
    """Drop the cached plans and the profiles read with them (bench/fit.py, after it writes a profile: a row whose
    flags leave its micro-batch to the search may plan another layout under the new numbers)."""
    _PLANS.clear()


def _cached_plan(row: Row):
    """row_plan of `row` once per process: a fit simulates every row many times with other profiles."""
    key = (str(row.path), row.flags)
    hit = _PLANS.get(key)
    if hit is None:
        hit = _PLANS[key] = row_plan(row)
    return hit
