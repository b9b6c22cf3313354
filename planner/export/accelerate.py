"""Export to Hugging Face accelerate: a config YAML for `accelerate launch --config_file`.

Keys follow accelerate's config files (1.10+, 2025): distributed_type,
num_machines, num_processes, machine_rank, main_process_ip/port,
rdzv_backend, mixed_precision, fsdp_config (fsdp_version 2,
fsdp_reshard_after_forward, fsdp_offload_params,
fsdp_activation_checkpointing, ...) and parallelism_config
(parallelism_config_dp_replicate_size / _dp_shard_size / _tp_size / _cp_size).
accelerate builds its mesh (dp_replicate, dp_shard, cp, tp) in meshplan's
order and requires their product to equal num_processes.

accelerate has no pipeline parallelism and no optimizer-only sharding, and it
refuses TP/CP on top of plain DDP. Those parts are mapped to the nearest
thing it runs (stated in the notes): PP ranks fold into dp_shard, ZeRO-1 and
DDP-under-TP become FSDP2 without resharding after forward (ZeRO-2).

A CPU cluster runs as accelerate's MULTI_CPU, which refuses any
parallelism_config (and FSDP needs a GPU), so a CPU plan is exported as
plain DDP over every rank, with the accumulation that keeps the global batch
and the predicted cost. `rdzv_backend` in a config file is ignored by
`accelerate launch` (its --rdzv_backend flag defaults to "static" and wins),
so multi-node exports put --rdzv_backend c10d on the launch line too.

Batch sizes are not part of an accelerate config (the training script sets
the DataLoader batch and Accelerator(gradient_accumulation_steps=...)), so
the file carries them as one comment line the script's author can copy:
  # batch: per_device_batch_size=M gradient_accumulation_steps=G data_parallel_size=D global_batch_size=B
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from planner.export import ExportRefused, ExportResult
from planner.export.common import comment_block, lora_notes, notes_lines, predicted_change, summary_lines
from planner.layout import Layout
from planner.plan import Plan

PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
RDZV_PORT = 29500
LAUNCH_PREFIX = "on node i run: "  # the header line tests/consumers hands to accelerate's own parser


def export(plan: Plan, hosts: tuple[str, ...] = ()) -> ExportResult:
    if plan.cluster.gpu.kind == "cpu":
        return _cpu_export(plan, hosts)
    notes: list[str] = lora_notes(plan, "accelerate")
    lay, cl = plan.layout, plan.cluster
    sizes = _sizes(plan, notes)  # dp_replicate, dp_shard, tp, cp as accelerate will run them
    fsdp = sizes["dp_shard"] > 1 or lay.zero_stage > 0
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("FSDP" if fsdp else "MULTI_GPU") if plan.world_size > 1 else "NO",
        "mixed_precision": PRECISION[plan.training.dtype],
        "num_machines": cl.n_nodes,
        "num_processes": plan.world_size,
        "machine_rank": 0,
        "rdzv_backend": "c10d" if cl.n_nodes > 1 else "static",
        "same_network": True,
        "use_cpu": cl.gpu.kind == "cpu",
    }
    if cl.n_nodes > 1:
        if hosts:
            config["main_process_ip"] = hosts[0]
        config["main_process_port"] = RDZV_PORT
    if fsdp:
        config["fsdp_config"] = _fsdp_config(plan, notes)
    else:
        notes += _script_side_notes(plan)
    if fsdp or max(lay.tp, lay.cp) > 1:
        config["parallelism_config"] = {f"parallelism_config_{k}_size": v for k, v in sizes.items()}
    if lay.ep > 1:
        notes.append(f"ep {lay.ep}: accelerate has no expert parallelism")
    header = ["accelerate config (accelerate 1.10+) written by `meshplan export`"] + summary_lines(plan)
    header.append(_batch_line(plan, sizes["dp_replicate"] * sizes["dp_shard"], notes))
    return _result(plan, config, header, hosts, notes)


def _result(plan: Plan, config: dict[str, Any], header: list[str], hosts: tuple[str, ...],
            notes: list[str]) -> ExportResult:
    if plan.cluster.n_nodes > 1:
        notes.append("rdzv_backend c10d: `accelerate launch` ignores the config file's rdzv_backend (its flag "
                     "defaults to static), so the launch line below passes --rdzv_backend c10d")
        header.append(f"{LAUNCH_PREFIX}accelerate launch --config_file THIS --rdzv_backend c10d --machine_rank i"
                      + ("" if hosts else " --main_process_ip NODE0_ADDRESS") + " your_script.py")
    header += notes_lines(notes)
    text = comment_block(header) + yaml.safe_dump(config, sort_keys=False)
    return ExportResult("accelerate", text, "accelerate_config.yaml", tuple(notes))


def _cpu_export(plan: Plan, hosts: tuple[str, ...]) -> ExportResult:
    """MULTI_CPU: accelerate's only multi-process CPU mode is DDP over all ranks (no FSDP, no mesh)."""
    lay, cl, tr = plan.layout, plan.cluster, plan.training
    notes: list[str] = []
    world = plan.world_size
    if world > 1 and (lay.dp != world or lay.zero_stage > 0):
        accum = tr.global_batch_size // (lay.micro_batch_size * world)
        if accum < 1 or accum * lay.micro_batch_size * world != tr.global_batch_size:
            raise ExportRefused(
                f"accelerate runs CPU ranks as plain DDP only (MULTI_CPU refuses parallelism_config and FSDP); "
                f"the global batch {tr.global_batch_size} is not micro {lay.micro_batch_size} x accumulation x "
                f"{world} ranks for a whole accumulation: re-plan with a global batch that {world} ranks divide, "
                "or run this plan with `meshplan execute`")
        flat = Layout(dp_replicate=world, micro_batch_size=lay.micro_batch_size, grad_accum_steps=accum,
                      recompute=lay.recompute)
        notes.append(f"CPU cluster: accelerate's MULTI_CPU refuses parallelism_config and FSDP, so tp {lay.tp} x "
                     f"pp {lay.pp} x cp {lay.cp} x dp {lay.dp} (ZeRO-{lay.zero_stage}) runs as DDP over {world} "
                     f"ranks, accumulation {lay.grad_accum_steps} -> {accum}: " + predicted_change(plan, flat))
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_CPU" if world > 1 else "NO",
        "mixed_precision": PRECISION[tr.dtype],
        "num_machines": cl.n_nodes,
        "num_processes": world,
        "machine_rank": 0,
        "rdzv_backend": "c10d" if cl.n_nodes > 1 else "static",
        "same_network": True,
        "use_cpu": True,
    }
    if cl.n_nodes > 1:
        if hosts:
            config["main_process_ip"] = hosts[0]
        config["main_process_port"] = RDZV_PORT
    if lay.recompute != "none":
        notes.append(f"recompute {lay.recompute}: under DDP accelerate's config has no activation checkpointing; "
                     "enable it in the model (e.g. gradient_checkpointing_enable())")
    header = ["accelerate config (accelerate 1.10+) written by `meshplan export`"] + summary_lines(plan)
    header.append(_batch_line(plan, world, notes))
    return _result(plan, config, header, hosts, notes)


def _folded_batch(plan: Plan, dp: int) -> int:
    """The global batch accelerate runs with `dp` ranks: the plan's, or the nearest multiple of micro x dp."""
    micro, global_batch = plan.layout.micro_batch_size, plan.training.global_batch_size
    step = micro * dp
    return global_batch if global_batch % step == 0 else max(step, round(global_batch / step) * step)


def _batch_line(plan: Plan, dp: int, notes: list[str]) -> str:
    """The batch settings the training script needs, for the data-parallel size accelerate will run."""
    micro = plan.layout.micro_batch_size
    global_batch = _folded_batch(plan, dp)
    accum = global_batch // (micro * dp)
    return (f"batch: per_device_batch_size={micro} gradient_accumulation_steps={accum} "
            f"data_parallel_size={dp} global_batch_size={global_batch}")


def _sizes(plan: Plan, notes: list[str]) -> dict[str, int]:
    """The four degrees accelerate can run; what it cannot is folded into dp_shard, with a note."""
    lay = plan.layout
    replicate, shard = lay.dp_replicate, lay.dp_shard
    if lay.zero_stage == 0 and max(lay.tp, lay.cp) > 1 and replicate > 1:
        notes.append(f"DDP with tp {lay.tp} / cp {lay.cp}: accelerate refuses TP/CP on plain DDP; dp_replicate "
                     f"{replicate} exported as dp_shard (FSDP2, ZeRO-2)")
        replicate, shard = 1, replicate
    if lay.pp > 1:
        shard *= lay.pp
        folded = lay.replace(pp=1, virtual_stages=1, dp_replicate=replicate, dp_shard=shard, layers_per_stage=(),
                             zero_stage=max(lay.zero_stage, 2), pp_schedule="1f1b")
        batch = _folded_batch(plan, replicate * shard)
        training = plan.training if batch == plan.training.global_batch_size else dataclasses.replace(
            plan.training, global_batch_size=batch)
        folded = folded.replace(grad_accum_steps=max(1, batch // (lay.micro_batch_size * replicate * shard)))
        notes.append(f"pp {lay.pp}: accelerate has no pipeline parallelism; the {lay.pp} stages fold into dp_shard "
                     f"({shard // lay.pp} -> {shard}), so every rank holds all {plan.model.n_layers} layers "
                     f"(sharded) and the accumulation steps shrink to keep the global batch"
                     + ("" if batch == plan.training.global_batch_size else
                        f"; {replicate * shard} ranks do not divide the global batch "
                        f"{plan.training.global_batch_size}, so it becomes {batch}")
                     + ": " + predicted_change(plan, folded, training=training))
    return {"dp_replicate": replicate, "dp_shard": shard, "tp": lay.tp, "cp": lay.cp}


def _fsdp_config(plan: Plan, notes: list[str]) -> dict[str, Any]:
    lay = plan.layout
    if lay.zero_stage == 1:
        notes.append("ZeRO-1: accelerate's FSDP2 has no optimizer-only sharding; exported without resharding "
                     "after forward (ZeRO-2: gradients sharded over dp_shard too)")
    if lay.recompute == "selective":
        notes.append("recompute 'selective': fsdp_activation_checkpointing recomputes whole layers (full)")
    if lay.offload == "optimizer":
        notes.append("offload 'optimizer': fsdp_offload_params moves parameters and gradients to the host too")
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": lay.zero_stage == 3,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_offload_params": lay.offload != "none",
        "fsdp_activation_checkpointing": lay.recompute != "none",
    }


def _script_side_notes(plan: Plan) -> list[str]:
    """Under plain DDP (MULTI_GPU) the config has no place for recompute or offload."""
    lay = plan.layout
    notes = []
    if lay.recompute != "none":
        notes.append(f"recompute {lay.recompute}: under DDP accelerate's config has no activation checkpointing; "
                     "enable it in the model (e.g. gradient_checkpointing_enable())")
    if lay.offload != "none":
        notes.append(f"offload {lay.offload}: accelerate offloads only under FSDP")
    return notes
