"""Every export of a set of real plans, loaded by the engine that would run it.

Plans come from the `plan` verb (every engine, every parallel dimension:
tp, interleaved and uneven pp, dp, ZeRO 0-3, HSDP, cp, full recompute, a
CPU cluster), are exported to every target (multi-node ones with --hosts),
and each file is loaded by DeepSpeed, accelerate, torchtitan 0.2 or
Megatron-Core under a fake process group of the plan's world size. A
consumer that rejects an export fails the test with its own error; the
values it reads back must equal the plan's, or differ exactly where the
export's notes say what changed. A target that cannot run a plan must
refuse it with ExportRefused (exit 2 from the CLI), never write a file the
consumer rejects.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
from conftest import run_cli
from consumer_checks import (
    accelerate_values,
    deepspeed_engine,
    deepspeed_values,
    megatron_values,
    torchtitan_values,
)

from planner.engines import get_engine
from planner.export import ExportRefused, export_plan
from planner.export.torchtitan import FLAVORS, SCHEDULES
from planner.plan import Plan, load_plan

# name -> `meshplan plan` flags. Kept small: each plan is exported to every target.
PLANS = {
    "default-8b": ("--model", "llama3-8b", "--gpus", "16"),
    "3d-interleaved": ("--model", "llama3-8b", "--gpus", "32", "--engine", "megatron", "--tp", "4", "--pp", "4",
                       "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2", "--zero", "1",
                       "--recompute", "full"),
    "uneven-3-stage": ("--model", "llama3-8b", "--gpus", "24", "--engine", "megatron", "--tp", "4", "--pp", "3",
                       "--zero", "1"),
    "ds-zero3-tp": ("--model", "llama3-8b", "--gpus", "16", "--engine", "deepspeed", "--tp", "2", "--zero", "3"),
    # ZeRO-2 with pp: DeepSpeed's PipelineEngine runs ZeRO 0-1 only, so `--engine deepspeed` never plans it;
    # a meshplan plan of it exported to DeepSpeed is rewritten as ZeRO-1 with the cost stated
    "zero2-pp": ("--model", "llama3-8b", "--gpus", "16", "--pp", "2", "--tp", "2", "--zero", "2"),
    "hsdp-zero3": ("--model", "llama3-8b", "--gpus", "32", "--tp", "4", "--dp", "8", "--dp-shard", "4",
                   "--zero", "3"),
    "cp": ("--model", "llama3-8b", "--gpus", "16", "--engine", "megatron", "--tp", "4", "--cp", "2",
           "--zero", "1"),
    "ddp-tp-pp": ("--model", "llama3-8b", "--gpus", "32", "--tp", "4", "--pp", "4", "--zero", "0",
                  "--pp-schedule", "1f1b"),
    "cpu": ("--model", "debug", "--cluster", "cpu", "--gpus", "4"),
    # full fine-tuning of 7-8B models on 4x RTX 4090 with model state in host memory
    "ds-offload-params": ("--model", "tests/data/hf_configs/qwen2.5-7b.json", "--cluster", "rtx4090-pcie", "--gpus",
                          "4", "--engine", "deepspeed", "--offload", "params"),
    "ds-offload-optimizer": ("--model", "tests/data/hf_configs/qwen2.5-7b.json", "--cluster", "rtx4090-pcie",
                             "--gpus", "4", "--engine", "deepspeed", "--offload", "optimizer"),
    "fsdp-offload-8b": ("--model", "llama3-8b", "--cluster", "rtx4090-pcie", "--gpus", "4", "--offload", "auto"),
    "13b-default": ("--model", "13B", "--gpus", "16"),
    "moe-ep": ("--model", "mixtral-8x7b", "--gpus", "16", "--engine", "megatron"),
    "tt-fp8-compile": ("--model", "llama3-8b", "--gpus", "16", "--engine", "torchtitan", "--precision", "fp8",
                       "--compile"),
}
HOSTS = {2: "h0,h1", 3: "h0,h1,h2", 4: "h0,h1,h2,h3"}


@functools.cache
def plan_of(name: str) -> Plan:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        r = run_cli("plan", *PLANS[name], "--top", "1", "--json", "-o", str(path), timeout=600)
        assert r.code == 0, r.stderr
        return load_plan(path)


def write(plan: Plan, target: str, folder: Path, version: str | None = None):
    """Export as `meshplan export -o` would (extra files next to the main one); hosts for multi-node plans."""
    hosts = HOSTS[plan.cluster.n_nodes].split(",") if plan.cluster.n_nodes > 1 else None
    result = export_plan(plan, target, hosts=hosts, version=version)
    (folder / result.filename).write_text(result.text)
    for name, text in result.extra_files:
        (folder / name).write_text(text)
    return result


def noted(result, *words: str) -> bool:
    return any(all(w in note for w in words) for note in result.notes)


@pytest.mark.parametrize("name", PLANS)
def test_deepspeed_accepts(name, tmp_path):
    plan = plan_of(name)
    lay = plan.layout
    result = write(plan, "deepspeed", tmp_path)
    got = deepspeed_values(tmp_path, plan.world_size)
    assert (got["dp"], got["micro"], got["accum"], got["global_batch"]) == (
        lay.dp, lay.micro_batch_size, lay.grad_accum_steps, plan.training.global_batch_size)
    assert (got["tp"], got["pp"]) == (lay.tp, lay.pp)
    if lay.pp > 1 and lay.zero_stage >= 2:  # PipelineEngine: ZeRO 0-1 only, stated with its cost
        assert got["zero"] == 1 and noted(result, f"ZeRO-{lay.zero_stage} with pp", "predicted step")
    elif lay.zero_stage == 0 and plan.training.grad_dtype != plan.training.dtype:  # the engine's dtype rule
        assert got["zero"] == 1 and noted(result, "ZeRO-0 with", "exported as ZeRO-1")
    else:
        assert got["zero"] == lay.zero_stage
    if lay.hsdp and got["zero"] == 3:
        assert got["hpz"] == lay.dp_shard and noted(result, "HSDP", "predicted step")
    if lay.tp * lay.pp * lay.cp > 1:
        assert noted(result, "mpu", "meshplan_ds_mpu.py")
    # the engine itself must take the ZeRO stage, the dtypes, the grid and the offload
    engine = deepspeed_engine(tmp_path, plan.world_size)
    kind = "PipelineEngine" if lay.pp > 1 else "DeepSpeedEngine"
    assert {k: engine[k] for k in ("engine", "zero", "dp", "global_batch", "stages")} == {
        "engine": kind, "zero": got["zero"], "dp": lay.dp, "global_batch": plan.training.global_batch_size,
        "stages": lay.pp}
    if lay.offload != "none":
        assert engine["optimizer"] == "DeepSpeedCPUAdam" and noted(result, "CPU AdamW")
        assert engine["offload"] == {"optimizer": "cpu", "param": "cpu" if lay.offload == "optimizer+params"
                                     else None}
    else:
        assert engine["offload"] == {"optimizer": None, "param": None}


@pytest.mark.parametrize("name", PLANS)
def test_accelerate_accepts(name, tmp_path):
    plan = plan_of(name)
    lay, tr = plan.layout, plan.training
    result = write(plan, "accelerate", tmp_path)
    got = accelerate_values(tmp_path / result.filename)
    assert got["num_processes"] == plan.world_size
    if plan.cluster.n_nodes > 1:
        assert got["rdzv_backend"] == "c10d"
    b = got["batch"]
    assert b["per_device_batch_size"] * b["gradient_accumulation_steps"] * b["data_parallel_size"] == b["global_batch_size"]
    if b["global_batch_size"] != tr.global_batch_size:
        assert noted(result, "becomes", str(b["global_batch_size"]))
    if plan.cluster.gpu.kind == "cpu":
        assert got["use_cpu"] and got["parallelism"] is None and got["distributed_type"] == "DistributedType.MULTI_CPU"
        return
    pc = got["parallelism"]
    if pc is not None:
        assert (pc["tp"], pc["cp"], pc["total"]) == (lay.tp, lay.cp, plan.world_size)
        assert pc["dp_replicate"] * pc["dp_shard"] == lay.dp * lay.pp == b["data_parallel_size"]


@pytest.mark.parametrize("name", PLANS)
def test_torchtitan_accepts_or_refuses(name, tmp_path):
    plan = plan_of(name)
    lay, m = plan.layout, plan.model
    if (m.hidden, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab) not in FLAVORS:
        with pytest.raises(ExportRefused, match="registered flavors"):
            write(plan, "torchtitan", tmp_path)
        return
    result = write(plan, "torchtitan", tmp_path)
    got = torchtitan_values(tmp_path / result.filename, plan.world_size, m.n_layers)
    assert got["registered"], got["flavor"]
    assert (got["tp"], got["cp"], got["pp"]) == (lay.tp, lay.cp, lay.pp)
    assert got["dp_replicate"] * got["dp_shard"] == lay.dp
    if noted(result, "refuses DDP"):
        assert (got["dp_replicate"], got["dp_shard"], got["reshard"]) == (1, lay.dp, "never")
    else:
        assert (got["dp_replicate"], got["dp_shard"]) == (lay.dp_replicate, lay.dp_shard)
    assert got["global_batch"] == plan.training.global_batch_size
    assert got["compile"] == (plan.training.compile or (plan.training.async_tp and lay.tp > 1))
    if plan.training.precision == "fp8":  # torchao tensorwise float8, float8 all-gathers, output layer in bf16
        assert got["converters"] == ["quantize.linear.float8"] and got["float8_all_gather"]
        assert got["float8_linears"] == 7 * m.n_layers and not got["output_float8"]
    else:
        assert got["converters"] == []
    assert got["ac"] == lay.recompute
    if lay.pp > 1:
        assert got["local_batch"] == lay.micro_batch_size * lay.grad_accum_steps
        assert got["pp_microbatch"] == lay.micro_batch_size
        assert got["schedule"] == "Schedule" + SCHEDULES[lay.pp_schedule]
        stages = [len(r) for r in _ranges(plan)]
        ranks = lay.pp
        assert got["layers_per_part"] == stages[0::ranks][:len(got["layers_per_part"])]
    else:
        assert got["local_batch"] == lay.micro_batch_size


def _ranges(plan):
    from planner.export.common import stage_layers
    from planner.layout import stage_ranges

    return stage_ranges(stage_layers(plan))


@pytest.mark.parametrize("name", PLANS)
def test_megatron_accepts(name, tmp_path):
    plan = plan_of(name)
    lay = plan.layout
    result = write(plan, "megatron", tmp_path)
    got = megatron_values(tmp_path / result.filename, plan.world_size)
    assert (got["tp"], got["pp"], got["cp"], got["vpp"]) == (lay.tp, lay.pp, lay.cp, lay.virtual_stages)
    assert (got["dp"], got["micro"], got["accum"], got["global_batch"]) == (
        lay.dp, lay.micro_batch_size, lay.grad_accum_steps, plan.training.global_batch_size)
    assert got["recompute"] == lay.recompute
    assert got["layers_per_stage"] == [len(r) for r in _ranges(plan)]
    if plan.model.moe is not None:  # Megatron's expert grid: ep x etp x expert-dp ranks per pipeline stage
        assert (got["experts"], got["ep"], got["etp"]) == (plan.model.moe.n_experts, lay.ep, lay.etp)
        assert got["ep"] * got["etp"] * got["expert_dp"] * lay.pp == plan.world_size
    assert got["distributed_optimizer"] == (lay.zero_stage >= 1)


@pytest.mark.parametrize("target", ["torchrun", "slurm"])
@pytest.mark.parametrize("name", PLANS)
def test_launch_states_the_executor_refusal(name, target, tmp_path):
    plan = plan_of(name)
    result = write(plan, target, tmp_path)
    refusal = get_engine("meshplan").refusal(plan.model, plan.layout, plan.training.dtype,
                                              plan.cluster.gpu.kind == "gpu")
    if refusal is None:
        assert "could not express: nothing" in result.text and not result.notes
    else:
        assert noted(result, "refuses this plan", "meshplan export --to")
        assert refusal in result.text


def test_cli_refusal_exits_2(tmp_path):
    plan = plan_of("13b-default")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    r = run_cli("export", str(path), "--to", "torchtitan")
    assert r.code == 2 and "registered flavors" in r.stderr
