"""Export to torchtitan: a job config TOML.

Field names follow torchtitan's TOML JobConfig (torchtitan/config/job_config.py
of the 0.2 line, 2025): [training] local_batch_size / global_batch_size /
seq_len / mixed_precision_param / enable_cpu_offload, [parallelism]
data_parallel_replicate_degree / data_parallel_shard_degree /
fsdp_reshard_after_forward / tensor_parallel_degree / context_parallel_degree /
pipeline_parallel_degree / pipeline_parallel_schedule /
pipeline_parallel_microbatch_size / module_fqns_per_model_part /
expert_parallel_degree, [activation_checkpoint] mode. (torchtitan's main
branch has since moved to Python config objects and renamed two PP fields:
pipeline_parallel_module_fqns_per_model_part and num_pp_microbatches.)

torchtitan orders its mesh pp, dp_replicate, dp_shard, cp, tp -- the same as
meshplan's rank grid -- so the degrees carry over one to one.

Batch arithmetic. torchtitan runs global_batch_size // (local_batch_size * dp)
gradient-accumulation steps, and with PP splits each local batch into
local_batch_size // pipeline_parallel_microbatch_size microbatches. So:
  no PP:  local = micro,              accumulation = grad_accum_steps
  PP:     local = micro * grad_accum, microbatches = grad_accum_steps, accumulation 1
and in both cases global = micro * grad_accum * dp, as in the plan.
"""

from __future__ import annotations

from typing import Any

from planner.export import ExportResult
from planner.export.common import notes_lines, stage_layers, summary_lines
from planner.export.toml_emit import dumps
from planner.layout import stage_ranges
from planner.plan import Plan

# meshplan pp_schedule -> torch.distributed.pipelining schedule name (get_schedule_class)
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zb-v": "ZBVZeroBubble"}
# meshplan dtype -> training.mixed_precision_param (torchtitan accepts bfloat16 or float32)
PARAM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def export(plan: Plan) -> ExportResult:
    notes: list[str] = []
    tables: dict[str, dict[str, Any]] = {
        "job": {"description": f"meshplan export: {plan.model.name} on {plan.world_size} ranks"},
        "model": _model(plan, notes),
        "training": _training(plan, notes),
        "parallelism": _parallelism(plan, notes),
        "activation_checkpoint": _activation_checkpoint(plan, notes),
    }
    header = ["torchtitan job config (TOML JobConfig, torchtitan 0.2) written by `meshplan export`"]
    header += summary_lines(plan) + notes_lines(notes)
    text = dumps(tables, header)
    return ExportResult("torchtitan", text, f"{plan.model.name}.toml", tuple(notes))


def _model(plan: Plan, notes: list[str]) -> dict[str, Any]:
    m = plan.model
    notes.append(
        f"model shape: torchtitan reads it from a registered flavor, not from this file; register flavor "
        f"{m.name!r} with dim={m.hidden}, n_layers={m.n_layers}, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}, "
        f"vocab_size={m.vocab}, FFN hidden {m.ffn_hidden}"
    )
    if (m.mlp, m.norm, m.position, m.bias) != ("swiglu", "rmsnorm", "rope", False) or m.moe is not None:
        notes.append(
            f"architecture: torchtitan's llama3 is SwiGLU + RMSNorm + RoPE without biases; this model has "
            f"mlp={m.mlp}, norm={m.norm}, position={m.position}, bias={m.bias}, moe={m.moe is not None}"
        )
    return {"name": "llama3", "flavor": m.name}


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
    if tr.fp8:  # torchao float8 / MX converters: their TOML keys differ between torchtitan releases
        notes.append(f"precision {tr.precision}: enable torchtitan's {'float8' if tr.precision == 'fp8' else 'mx'} "
                     "model converter with FSDP float8 all-gathers (what the plan assumed); not written here")
    if tr.compile:
        notes.append("compile: enable torchtitan's torch.compile of the model (per block); not written here")
    if lay.offload != "none":
        entries["enable_cpu_offload"] = True
        if lay.offload == "optimizer":
            notes.append("offload 'optimizer': torchtitan's enable_cpu_offload moves parameters and gradients "
                         "to the host too (FSDP2 CPUOffloadPolicy); slower than the plan assumed")
        if lay.zero_stage == 0:
            notes.append("offload needs FSDP in torchtitan, but the plan shards nothing (ZeRO-0)")
    return entries


def _parallelism(plan: Plan, notes: list[str]) -> dict[str, Any]:
    lay = plan.layout
    entries: dict[str, Any] = {
        "data_parallel_replicate_degree": lay.dp_replicate,
        "data_parallel_shard_degree": lay.dp_shard,
    }
    if lay.zero_stage > 0:
        entries["fsdp_reshard_after_forward"] = "always" if lay.zero_stage == 3 else "never"
    if lay.zero_stage == 1:
        notes.append(f"ZeRO-1: torchtitan has no optimizer-only sharding; exported as FSDP2 without resharding "
                     f"after forward (ZeRO-2: gradients sharded over dp_shard {lay.dp_shard} too)")
    if lay.zero_stage == 0 and lay.dp_replicate > 1 and max(lay.tp, lay.cp, lay.pp) > 1:
        notes.append(f"DDP with tp {lay.tp} / cp {lay.cp} / pp {lay.pp}: torchtitan applies DDP only to 1-D "
                     f"meshes; use ZeRO-2 (data_parallel_shard_degree) instead")
    if lay.cp > 1 and lay.zero_stage > 0:
        notes.append(f"cp {lay.cp}: torchtitan shards FSDP over dp_shard * cp = {lay.dp_shard * lay.cp} ranks, "
                     f"meshplan over dp_shard {lay.dp_shard}; per-rank model state is smaller than planned")
    entries["tensor_parallel_degree"] = lay.tp
    if lay.tp > 1 and not lay.sequence_parallel:
        notes.append(f"sequence_parallel off: torchtitan always uses sequence parallel with tp {lay.tp}")
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


def _activation_checkpoint(plan: Plan, notes: list[str]) -> dict[str, Any]:
    mode = plan.layout.recompute
    if mode == "op":  # torchtitan's own per-op selective checkpointing, what meshplan models
        return {"mode": "selective", "selective_ac_option": "op"}
    if mode != "selective":
        return {"mode": mode}
    notes.append("recompute 'selective': torchtitan's per-op selective AC saves matmul and attention outputs "
                 "by its own policy; meshplan modelled recomputing the attention core only")
    return {"mode": "selective", "selective_ac_option": "op"}
