"""Export to torchtitan: a job config TOML (0.2) or a Python config module (0.3).

torchtitan 0.2 reads a TOML JobConfig (torchtitan/config/job_config.py):
[model] name / flavor, [training] local_batch_size / global_batch_size /
seq_len / mixed_precision_param / mixed_precision_reduce / enable_cpu_offload,
[parallelism] data_parallel_replicate_degree / data_parallel_shard_degree /
fsdp_reshard_after_forward / tensor_parallel_degree / context_parallel_degree /
pipeline_parallel_degree / pipeline_parallel_schedule /
pipeline_parallel_microbatch_size / module_fqns_per_model_part /
expert_parallel_degree, [activation_checkpoint] mode. torchtitan 0.3 dropped
TOML: `torchtitan.train --module M --config F` imports module M and calls F()
for a Trainer.Config, so the 0.3 export is such a module, starting from the
registered llama3 config of the model and setting TrainingConfig,
ParallelismConfig (same field names, plus enable_sequence_parallel) and the
activation checkpointing policy object. tests/consumers loads both with
torchtitan's ConfigManager and parallelizes a meta model under a fake group.

The model shape comes from a flavor torchtitan registers (0.2: debugmodel,
8B, 70B, 405B; 0.3 also 1B, 3B), never from the file, so a model whose shape
is none of them is refused rather than trained at the wrong size.

torchtitan orders its mesh pp, dp_replicate, dp_shard, cp, tp, the same as
meshplan's rank grid, so the degrees carry over one to one, except plain DDP
next to TP/PP: torchtitan 0.2's parallelize_llama refuses DDP on a mesh of
more than one dimension, so those replicas are exported as FSDP2 shards
without resharding after forward (ZeRO-2), with the predicted cost.

Batch arithmetic. torchtitan runs global_batch_size // (local_batch_size * dp)
gradient-accumulation steps, and with PP splits each local batch into
local_batch_size // pipeline_parallel_microbatch_size microbatches. So:
  no PP:  local = micro,              accumulation = grad_accum_steps
  PP:     local = micro * grad_accum, microbatches = grad_accum_steps, accumulation 1
and in both cases global = micro * grad_accum * dp, as in the plan.
"""

from __future__ import annotations

import re
from typing import Any

from planner.engines import engine_name
from planner.export import ExportRefused, ExportResult
from planner.export.common import (
    comment_block,
    lora_notes,
    notes_lines,
    predicted_change,
    stage_layers,
    summary_lines,
)
from planner.export.toml_emit import dumps
from planner.layout import Layout, stage_ranges
from planner.plan import Plan

# meshplan pp_schedule -> torch.distributed.pipelining schedule name (get_schedule_class)
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zb-v": "ZBVZeroBubble",
             "dualpipev": "DualPipeV"}
# meshplan dtype -> training.mixed_precision_param (torchtitan accepts bfloat16 or float32)
PARAM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# llama3 flavors torchtitan registers: (hidden, layers, heads, kv heads, vocab) -> (flavor, first release, 0.3 config)
FLAVORS = {
    (4096, 32, 32, 8, 128256): ("8B", (0, 2), "llama3_8b"),
    (8192, 80, 64, 8, 128256): ("70B", (0, 2), "llama3_70b"),
    (16384, 126, 128, 8, 128256): ("405B", (0, 2), "llama3_405b"),
    (2048, 16, 32, 8, 128256): ("1B", (0, 3), None),
    (3072, 28, 24, 8, 128256): ("3B", (0, 3), None),
}
PYTHON_CONFIGS = (0, 3)  # first release configured by a Python module instead of TOML


def _engine(plan: Plan) -> str:
    """Who prices a changed layout: the plan's torchtitan release, else torchtitan's newest."""
    return plan.engine if engine_name(plan.engine) == "torchtitan" else "torchtitan"


def export(plan: Plan, version: tuple[int, ...] = (0, 2)) -> ExportResult:
    notes: list[str] = lora_notes(plan, "torchtitan")
    flavor, config_fn = model_flavor(plan, version)
    notes += _model_notes(plan)
    training = _training(plan, notes)
    run = _runnable_layout(plan, version, notes)
    parallelism = _parallelism(plan, run, version, notes)
    ac = plan.layout.recompute
    if ac == "op":  # torchtitan's own per-op selective checkpointing: what meshplan modelled
        ac = "selective"
    elif ac == "selective":
        notes.append("recompute 'selective': torchtitan's per-op selective AC saves matmul and attention outputs "
                     "by its own policy; meshplan modelled recomputing the attention core only")
    notes += _engine_notes(plan)
    header = summary_lines(plan) + notes_lines(notes)
    compile_cfg = _compile(plan, version, parallelism)
    if version >= PYTHON_CONFIGS:
        if plan.training.fp8:
            notes.append(f"precision {plan.training.precision}: torchtitan 0.3's float8 converter runs the rowwise "
                         "recipes only, without the tensorwise float8 all-gathers the plan assumed; not written "
                         "here (export --version 0.2 writes it)")
            header = summary_lines(plan) + notes_lines(notes)
        return _python_module(plan, config_fn, training, parallelism, ac, header, notes, compile_cfg)
    converters, quantize = _quantize(plan)
    tables: dict[str | tuple[str, ...], dict[str, Any]] = {
        "job": {"description": f"meshplan export: {plan.model.name} on {plan.world_size} ranks"},
        "model": {"name": "llama3", "flavor": flavor, **({"converters": converters} if converters else {})},
        "training": training,
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": ac, **({"selective_ac_option": "op"} if ac == "selective" else {})},
        **({"compile": compile_cfg} if compile_cfg else {}),
        **quantize,
    }
    text = dumps(tables, ["torchtitan job config (TOML JobConfig, torchtitan 0.2) written by `meshplan export`"]
                 + header)
    return ExportResult("torchtitan", text, f"{plan.model.name}.toml", tuple(notes))


def _compile(plan: Plan, version: tuple[int, ...], parallelism: dict[str, Any]) -> dict[str, Any]:
    """The [compile] entries of a compiled plan, or of async TP, which needs the compile ({} otherwise).

    torchtitan compiles each block (and the loss) when `compile.enable`; it
    runs async TP as an Inductor pass over the compiled model and refuses it
    unless the model is compiled. 0.2 reads
    `[parallelism] enable_async_tensor_parallel`; 0.3 moved the switch to
    `compile.enable_async_tensor_parallel` (CompileConfig).
    """
    async_tp = plan.training.async_tp and plan.layout.tp > 1
    if not (plan.training.compile or async_tp):
        return {}
    entries: dict[str, Any] = {"enable": True, "components": ["model", "loss"]}
    if async_tp and version >= PYTHON_CONFIGS:
        entries["enable_async_tensor_parallel"] = True
    elif async_tp:
        parallelism["enable_async_tensor_parallel"] = True
    return entries


def _quantize(plan: Plan) -> tuple[list[str], dict[tuple[str, ...], dict[str, Any]]]:
    """torchtitan 0.2's model converter and its table for an 8-bit plan: ([], {}) otherwise.

    fp8 is torchao's tensorwise float8 with FSDP float8 all-gathers and their
    precomputed scales (config/job_config.py Float8Linear: no recipe_name, which
    those options refuse), mxfp8 torchao's MX linear (MXLinear, mxfp8_cublas);
    both keep the output layer in bf16, as meshplan's float8 recipe prices it.
    """
    precision = plan.training.precision
    if precision == "fp8":
        return ["quantize.linear.float8"], {("quantize", "linear", "float8"): {
            "enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True,
            "filter_fqns": ["output"]}}
    if precision == "mxfp8":
        return ["quantize.linear.mx"], {("quantize", "linear", "mx"): {"recipe_name": "mxfp8_cublas",
                                                               "filter_fqns": ["output"]}}
    return [], {}


def model_flavor(plan: Plan, version: tuple[int, ...]) -> tuple[str, str | None]:
    """The registered llama3 flavor with the plan's shape (and its 0.3 config function); refused otherwise."""
    m = plan.model
    key = (m.hidden, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab)
    hit = FLAVORS.get(key)
    if hit is None or version < hit[1] or (version >= PYTHON_CONFIGS and hit[2] is None):
        known = ", ".join(f"{name} (hidden {k[0]}, {k[1]} layers, {k[2]} heads, {k[3]} kv heads, vocab {k[4]})"
                          for k, (name, since, fn) in FLAVORS.items()
                          if version >= since and (fn or version < PYTHON_CONFIGS))
        raise ExportRefused(
            f"torchtitan builds llama3 models from registered flavors only: {known}; model {m.name!r} (hidden "
            f"{m.hidden}, {m.n_layers} layers, {m.n_heads} heads, {m.n_kv_heads} kv heads, vocab {m.vocab}) is "
            "none of them. Plan one of those models (e.g. --model llama3-8b), or export --to megatron or "
            "--to deepspeed, which take the shape from the export")
    return hit[0], hit[2]


def _model_notes(plan: Plan) -> list[str]:
    m = plan.model
    if (m.mlp, m.norm, m.position, m.bias) != ("swiglu", "rmsnorm", "rope", False) or m.moe is not None:
        return [f"architecture: torchtitan's llama3 is SwiGLU + RMSNorm + RoPE without biases; this model has "
                f"mlp={m.mlp}, norm={m.norm}, position={m.position}, bias={m.bias}, moe={m.moe is not None}"]
    return []


def _engine_notes(plan: Plan) -> list[str]:
    """Which engine predicted this plan, when it was not torchtitan."""
    if engine_name(plan.engine) == "torchtitan":
        return []
    return [f"prediction: this plan was made for --engine {plan.engine}; `meshplan plan ... --engine "
            "torchtitan` predicts torchtitan's own step (its layout choice may differ)"]


def _training(plan: Plan, notes: list[str]) -> dict[str, Any]:
    lay, tr = plan.layout, plan.training
    local = lay.micro_batch_size * (lay.grad_accum_steps if lay.pp > 1 else 1)
    entries: dict[str, Any] = {"local_batch_size": local, "global_batch_size": tr.global_batch_size,
                               "seq_len": tr.seq_len}
    if tr.dtype in PARAM_DTYPES:
        entries["mixed_precision_param"] = PARAM_DTYPES[tr.dtype]
    else:
        notes.append(f"dtype {tr.dtype}: torchtitan's mixed_precision_param takes bfloat16 or float32 only")
    entries["mixed_precision_reduce"] = "float32"
    if tr.grad_dtype != "fp32":
        notes.append(f"grad_dtype {tr.grad_dtype}: torchtitan reduces gradients in float32 only")
    if lay.offload != "none":
        entries["enable_cpu_offload"] = True
        if lay.offload == "optimizer":
            notes.append("offload 'optimizer': torchtitan's enable_cpu_offload moves parameters and gradients "
                         "to the host too (FSDP2 CPUOffloadPolicy); slower than the plan assumed")
        if lay.zero_stage == 0:
            notes.append("offload needs FSDP in torchtitan, but the plan shards nothing (ZeRO-0)")
    return entries


def ddp_refused(layout: Layout, version: tuple[int, ...]) -> bool:
    """Whether torchtitan would take the plan's replicas as DDP on a multi-dimensional mesh (0.2 refuses it).

    torchtitan 0.2 applies FSDP when dp_shard or cp > 1, else DDP when
    dp_replicate > 1; its DDP accepts a 1-D mesh only. 0.3 always uses FSDP2.
    """
    return (version < PYTHON_CONFIGS and layout.zero_stage == 0 and layout.dp_replicate > 1
            and layout.dp_shard == 1 and layout.cp == 1 and max(layout.tp, layout.pp) > 1)


def _runnable_layout(plan: Plan, version: tuple[int, ...], notes: list[str]) -> Layout:
    lay = plan.layout
    if not ddp_refused(lay, version):
        return lay
    run = lay.replace(dp_replicate=1, dp_shard=lay.dp, zero_stage=2)
    notes.append(f"DDP (dp_replicate {lay.dp_replicate}, ZeRO-0) with tp {lay.tp} / pp {lay.pp}: torchtitan 0.2 "
                 f"refuses DDP on a mesh of more than one dimension; exported as FSDP2 over data_parallel_shard_"
                 f"degree {lay.dp} without resharding after forward (ZeRO-2): "
                 + predicted_change(plan, run, _engine(plan)))
    return run


def _parallelism(plan: Plan, run: Layout, version: tuple[int, ...], notes: list[str]) -> dict[str, Any]:
    lay = plan.layout
    entries: dict[str, Any] = {
        "data_parallel_replicate_degree": run.dp_replicate,
        "data_parallel_shard_degree": run.dp_shard,
    }
    if run.zero_stage > 0:
        entries["fsdp_reshard_after_forward"] = "always" if run.zero_stage == 3 else "never"
    if lay.zero_stage == 1:
        notes.append(f"ZeRO-1: torchtitan has no optimizer-only sharding; exported as FSDP2 without resharding "
                     f"after forward (ZeRO-2: gradients sharded over dp_shard {lay.dp_shard} too): "
                     + predicted_change(plan, lay.replace(zero_stage=2), _engine(plan)))
    if lay.zero_stage == 0 and lay.dp_replicate > 1 and not ddp_refused(lay, version) and (
            version >= PYTHON_CONFIGS or lay.cp > 1):
        notes.append(f"ZeRO-0: torchtitan {'0.3' if version >= PYTHON_CONFIGS else '0.2 with cp > 1'} replicates "
                     f"over dp_replicate {lay.dp_replicate} with FSDP2 (fully_shard on a replicate mesh), "
                     "not torch DDP; the same memory, gradients reduced per FSDP unit")
    entries["tensor_parallel_degree"] = lay.tp
    if lay.tp > 1 and not lay.sequence_parallel:
        if version >= PYTHON_CONFIGS:
            entries["enable_sequence_parallel"] = False
        else:
            notes.append(f"sequence_parallel off: torchtitan 0.2 always uses sequence parallel with tp {lay.tp}")
    entries["context_parallel_degree"] = lay.cp
    entries["pipeline_parallel_degree"] = lay.pp
    if lay.pp > 1:
        entries["pipeline_parallel_schedule"] = SCHEDULES[lay.pp_schedule]
        entries["pipeline_parallel_microbatch_size"] = lay.micro_batch_size
        entries["module_fqns_per_model_part"] = _model_parts(plan)
    if lay.ep > 1:
        entries["expert_parallel_degree"] = lay.ep
    if lay.etp > 1:
        entries["expert_tensor_parallel_degree"] = lay.etp
    return entries


def _model_parts(plan: Plan) -> list[list[str]]:
    """Module names of each model chunk in model order: embedding first, norm and output last."""
    parts = [[f"layers.{i}" for i in r] for r in stage_ranges(stage_layers(plan))]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def module_name(plan: Plan) -> str:
    """The 0.3 config module's import name: meshplan_ + the model name as an identifier."""
    return "meshplan_" + re.sub(r"\W", "_", plan.model.name.lower())


def _python_module(plan: Plan, config_fn: str | None, training: dict[str, Any], parallelism: dict[str, Any],
                   ac: str, header: list[str], notes: list[str], compile_cfg: dict[str, Any]) -> ExportResult:
    """torchtitan 0.3's config: a module whose meshplan_plan() returns the registered config, re-parallelized."""
    name = module_name(plan)
    ac_expr = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}[ac]

    if plan.layout.pp > 1:  # Trainer.Config refuses CUDA graphs with pipeline parallelism (0.3)
        training = {**training, "disable_cuda_graphs": True}
        notes.append("CUDA graphs off: torchtitan 0.3 does not capture CUDA graphs with pipeline parallelism "
                     "(training.disable_cuda_graphs); meshplan's prediction assumed none either")
        header = summary_lines(plan) + notes_lines(notes)

    def assign(section: str, fields: dict[str, Any]) -> str:
        return "".join(f"    cfg.{section}.{k} = {v!r}\n" for k, v in fields.items())

    text = comment_block(["torchtitan config module (torchtitan 0.3) written by `meshplan export`",
                          f"run: PYTHONPATH=<this folder> torchrun --nproc-per-node {plan.cluster.gpus_per_node} "
                          f"... -m torchtitan.train --module {name} --config meshplan_plan"] + header)
    text += ("from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401\n"
             f"from torchtitan.models.llama3.config_registry import {config_fn}\n\n\n"
             "def meshplan_plan():\n"
             f'    """torchtitan\'s registered {config_fn}() with the plan\'s batch, degrees and recompute."""\n'
             f"    cfg = {config_fn}()\n"
             + assign("training", training) + assign("parallelism", parallelism) + assign("compile", compile_cfg) +
             f"    cfg.activation_checkpoint = {ac_expr}\n"
             "    return cfg\n")
    return ExportResult("torchtitan", text, f"{name}.py", tuple(notes))
