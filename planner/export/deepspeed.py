"""Export to DeepSpeed: ds_config.json, an mpu module, and a hostfile when hosts are given.

Keys follow DeepSpeed's config-json reference (checked by loading every export
with deepspeed.runtime.config.DeepSpeedConfig of 0.19.8, tests/consumers):
train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
bf16/fp16.enabled, data_types.grad_accum_dtype, zero_optimization.stage /
offload_optimizer / offload_param / mics_shard_size (before 0.19.7) /
zero_hpz_partition_size, tensor_parallel.autotp_size, and with optimizer
offload optimizer.type (DeepSpeed then steps with its CPU Adam). A hostfile has one
`host slots=N` line per node.

The data-parallel size. DeepSpeed refuses a config unless
    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp
and takes dp from the `mpu` the script passes to deepspeed.initialize
(mpu.get_data_parallel_world_size()), else from the whole world: without an
mpu every TP, PP or CP rank counts as data parallel and the check fails. So
when the plan has model parallelism the export adds meshplan_ds_mpu.py,
whose build_mpu() returns DeepSpeed's own PipelineParallelGrid over the
plan's rank grid (pipe outermost, then data, then cp x tp as DeepSpeed's
"model" axis: meshplan's order), with get_data_parallel_world_size() == dp.

What a ds_config cannot say, and the nearest thing DeepSpeed runs:
- pipeline stages come from rewriting the model as deepspeed.pipe.PipelineModule
  (topology= the same grid); its PipelineEngine accepts ZeRO 0-1 only
  (runtime/pipe/engine.py), so ZeRO-2/3 with pp > 1 is exported as ZeRO-1;
- Megatron-style TP is AutoTP (tensor_parallel.autotp_size), which slices a
  Hugging Face-style model's Linear layers;
- context parallelism (Ulysses) uses process groups the script builds;
- HSDP: MiCS (mics_shard_size) until 0.18.x/0.19.6; 0.19.7 removed it and
  nothing replaces replicate x shard, so from 0.19.7 HSDP becomes ZeRO-3 over
  all dp ranks with ZeRO++ hpZ (zero_hpz_partition_size = dp_shard: a
  secondary parameter copy within each shard group).
Each changed setting comes with simulate_step's prediction of what it costs.
"""

from __future__ import annotations

import json
from typing import Any

from planner.export import ExportResult
from planner.export.common import lora_notes, predicted_change, stage_layers
from planner.layout import Layout
from planner.plan import Plan

MICS_REMOVED = (0, 19, 7)  # DeepSpeed release whose config rejects zero_optimization.mics_shard_size
MPU_FILE = "meshplan_ds_mpu.py"


def export(plan: Plan, hosts: tuple[str, ...] = (), version: tuple[int, ...] = (0, 19, 8)) -> ExportResult:
    notes: list[str] = lora_notes(plan, "deepspeed")
    lay, tr = plan.layout, plan.training
    run = _runnable_layout(plan, version, notes)
    config: dict[str, Any] = {
        "train_batch_size": tr.global_batch_size,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": lay.grad_accum_steps,
        "bf16": {"enabled": tr.dtype == "bf16"},
        "fp16": {"enabled": tr.dtype == "fp16"},
        "data_types": {"grad_accum_dtype": tr.grad_dtype},
        "zero_optimization": _zero(plan, run, version, notes),
    }
    if "offload_optimizer" in config["zero_optimization"]:
        # ZeRO-Offload steps on the host with DeepSpeedCPUAdam, which the engine builds from this section; a
        # client torch optimizer is refused under offload (engine.py: zero_force_ds_cpu_optimizer)
        config["optimizer"] = {"type": tr.optimizer.replace("adamw", "AdamW").replace("sgd", "SGD"), "params": {}}
        notes.append(f"offload: the host's optimizer step is DeepSpeed's CPU {config['optimizer']['type']}, built "
                     "from the config's optimizer section; pass no optimizer to deepspeed.initialize and set its "
                     "lr, betas and weight_decay there (DeepSpeed's defaults otherwise)")
    if lay.tp > 1:
        config["tensor_parallel"] = {"autotp_size": lay.tp}
    notes += _model_parallel_notes(plan)
    extra: list[tuple[str, str]] = []
    if lay.tp * lay.pp * lay.cp > 1:
        extra.append((MPU_FILE, mpu_module(plan)))
        how = ("deepspeed.pipe.PipelineModule(..., topology=meshplan_ds_mpu.topology())" if lay.pp > 1
               else "deepspeed.initialize(..., mpu=meshplan_ds_mpu.build_mpu())")
        notes.append(f"mpu: DeepSpeed counts every rank as data parallel unless the script passes the plan's "
                     f"grid; use {how} from {MPU_FILE} (written next to the config), whose data-parallel size "
                     f"is the plan's dp {lay.dp}, not world {plan.world_size}")
    if hosts:
        extra.append(("hostfile", hostfile(plan, hosts)))
    if lay.recompute != "none":
        notes.append(f"recompute {lay.recompute}: ds_config cannot switch activation checkpointing on; wrap each "
                     "layer with deepspeed.checkpointing.checkpoint (or the model's gradient checkpointing)")
    text = json.dumps(config, indent=2) + "\n"
    return ExportResult("deepspeed", text, "ds_config.json", tuple(notes), tuple(extra))


def mpu_module(plan: Plan) -> str:
    """Python source of meshplan_ds_mpu: DeepSpeed's own topology and grid for the plan's degrees."""
    lay = plan.layout
    return (
        f'"""DeepSpeed process grid for a meshplan plan ({plan.model.name}, {plan.world_size} ranks), '
        f'written by `meshplan export --to deepspeed`.\n\n'
        f"Axes as meshplan orders ranks: pipe {lay.pp} (outermost), data {lay.dp}, then cp {lay.cp} x tp "
        f"{lay.tp} = {lay.cp * lay.tp}\n"
        "as DeepSpeed's 'model' axis. Pass build_mpu() to deepspeed.initialize(mpu=...), or topology()\n"
        'to deepspeed.pipe.PipelineModule(topology=...), after torch.distributed is initialised.\n"""\n\n'
        "from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid\n\n"
        f"PP, DP, CP, TP = {lay.pp}, {lay.dp}, {lay.cp}, {lay.tp}\n\n\n"
        "def topology():\n"
        "    return PipeModelDataParallelTopology(num_pp=PP, num_mp=CP * TP, num_dp=DP)\n\n\n"
        "def build_mpu():\n"
        "    return PipelineParallelGrid(topology=topology())\n"
    )


def _runnable_layout(plan: Plan, version: tuple[int, ...], notes: list[str]) -> Layout:
    """The nearest layout DeepSpeed runs (ZeRO-1 under its PipelineEngine), with the cost of each change."""
    lay = plan.layout
    run = lay
    if lay.pp > 1 and lay.zero_stage >= 2:
        run = run.replace(zero_stage=1, offload="optimizer" if lay.offload != "none" else "none")
        notes.append(f"ZeRO-{lay.zero_stage} with pp {lay.pp}: DeepSpeed's PipelineEngine refuses ZeRO-2/3 "
                     f"(\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\"); exported as ZeRO-1 "
                     f"(gradients{' and parameters' if lay.zero_stage == 3 else ''} replicated): "
                     + predicted_change(plan, run, "deepspeed"))
    if run.zero_stage == 0 and dtype_mix(plan) and lay.dp > 1:
        run = run.replace(zero_stage=1, dp_replicate=1, dp_shard=lay.dp)
        notes.append(f"ZeRO-0 with {plan.training.dtype} weights and {plan.training.grad_dtype} gradient "
                     "accumulation: DeepSpeed's engine runs that mix only under ZeRO (\"unsupported mix of "
                     "model_dtype and grad_accum_dtype\" otherwise); exported as ZeRO-1, which keeps the "
                     "gradient precision and shards the optimizer state: " + predicted_change(plan, run, "deepspeed"))
    if lay.hsdp and (run.zero_stage < 3 or version >= MICS_REMOVED):
        flat = run.replace(dp_replicate=1, dp_shard=lay.dp)
        why = ("DeepSpeed 0.19.7 removed MiCS (mics_shard_size) and nothing replaces replicate x shard"
               if run.zero_stage == 3 else f"DeepSpeed's ZeRO-{run.zero_stage} has no replicate x shard groups")
        notes.append(f"HSDP (dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}): {why}; ZeRO-{run.zero_stage} "
                     f"shards over all {lay.dp} data-parallel ranks" +
                     (f", with ZeRO++ hpZ keeping a parameter copy within groups of {lay.dp_shard} "
                      "(zero_hpz_partition_size)" if run.zero_stage == 3 else "") + ": "
                     + predicted_change(plan, flat, "deepspeed"))
        run = flat
    return run


def hostfile(plan: Plan, hosts: tuple[str, ...]) -> str:
    """DeepSpeed's hostfile: `host slots=GPUs` per node, node 0 first."""
    return "".join(f"{host} slots={plan.cluster.gpus_per_node}\n" for host in hosts)


def dtype_mix(plan: Plan) -> bool:
    """bf16/fp16 weights with gradients accumulated in another dtype: DeepSpeed needs ZeRO >= 1 for it."""
    return plan.training.dtype in ("bf16", "fp16") and plan.training.grad_dtype != plan.training.dtype


def _zero(plan: Plan, run: Layout, version: tuple[int, ...], notes: list[str]) -> dict[str, Any]:
    lay = plan.layout
    stage = run.zero_stage
    if stage == 0 and dtype_mix(plan):  # dp 1: ZeRO-1 over one rank shards nothing, and lets the engine run
        stage = 1
        notes.append(f"ZeRO-0 with {plan.training.dtype} weights and {plan.training.grad_dtype} gradient "
                     "accumulation: DeepSpeed's engine runs that mix only under ZeRO; exported as ZeRO-1, which "
                     "with dp 1 shards nothing: no change in time or memory")
    zero: dict[str, Any] = {"stage": stage}
    if lay.offload != "none":
        if stage == 0:
            notes.append("offload: DeepSpeed offloads only under ZeRO 1-3, and the plan uses ZeRO-0")
        else:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if lay.offload == "optimizer+params":
        if run.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        else:
            notes.append(f"parameter offload: DeepSpeed offloads parameters only under ZeRO-3, the export uses "
                         f"ZeRO-{run.zero_stage}")
    if lay.hsdp and run.zero_stage == 3:
        if version < MICS_REMOVED:
            zero["mics_shard_size"] = lay.dp_shard
            notes.append(f"HSDP is exported as MiCS (shards of {lay.dp_shard} ranks, replicated "
                         f"{lay.dp_replicate} times): build the model under deepspeed.zero.MiCS_Init")
        else:
            zero["zero_hpz_partition_size"] = lay.dp_shard
    return zero


def _model_parallel_notes(plan: Plan) -> list[str]:
    lay = plan.layout
    notes = []
    if lay.tp > 1:
        notes.append(f"tp {lay.tp}: plain DeepSpeed has no Megatron-style tensor parallelism; exported as AutoTP "
                     f"(tensor_parallel.autotp_size {lay.tp}, DeepSpeed >= 0.16.4), which slices a Hugging "
                     f"Face-style model's Linear layers; for Megatron TP use Megatron-DeepSpeed")
    if lay.sequence_parallel:
        notes.append("sequence_parallel: AutoTP does not shard norms and dropout along the sequence")
    if lay.pp > 1:
        notes.append(f"pp {lay.pp}: a ds_config cannot set pipeline stages; rewrite the model as "
                     f"deepspeed.pipe.PipelineModule(num_stages={lay.pp}) with layers per stage "
                     f"{list(stage_layers(plan))}")
        if lay.pp_schedule != "1f1b":
            notes.append(f"pp_schedule {lay.pp_schedule}: DeepSpeed's pipeline engine runs its own 1F1B schedule")
    if lay.cp > 1:
        notes.append(f"cp {lay.cp}: context parallelism (DeepSpeed-Ulysses) needs sequence-parallel process groups "
                     f"built by the training script; {MPU_FILE} counts the cp ranks in the model axis, so "
                     f"DeepSpeed's data-parallel groups are the plan's")
    if lay.ep > 1:
        notes.append(f"ep {lay.ep}: expert parallelism is set in the model code (deepspeed.moe.layer.MoE ep_size)")
    return notes
