"""Round trips of `meshplan export`: parse each output back with the reader its engine uses
(tomllib, json, yaml.safe_load) and check that the degrees and the batch arithmetic survive.

The plan builders here are shared with tests/test_export_megatron.py and test_export_launch.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
from hypothesis import example, given, settings
from hypothesis import strategies as st

from planner.export import TARGETS, ExportRefused, ExportResult, export_plan
from planner.export.toml_emit import dumps
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, load_plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib


def make_plan(n_gpus: int, model: str = "13B", **layout) -> Plan:
    spec = load_model(model)
    return Plan(model=spec, cluster=load_cluster("dgx-h100", n_gpus),
                training=TrainingSpec(seq_len=4096, global_batch_size=256),
                layout=with_stage_layers(spec, Layout(**layout)))


def plan_13b() -> Plan:
    """The README's 13B / 16-GPU plan: TP 8 inside a node, ZeRO-3 over the two nodes."""
    return make_plan(16, tp=8, dp_shard=2, zero_stage=3, micro_batch_size=1, grad_accum_steps=128)


def plan_3d() -> Plan:
    """tp 4 x pp 4 x dp 2 with the interleaved schedule (2 chunks per rank), ZeRO-1, full recompute."""
    return make_plan(32, tp=4, pp=4, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=128,
                     sequence_parallel=True, pp_schedule="interleaved-1f1b", virtual_stages=2, recompute="full")


@functools.cache
def plan_verb(*args: str) -> Plan:
    """The real output of `meshplan plan ARGS --json -o plan.json`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        r = run_cli("plan", *args, "--json", "-o", str(path))
        assert r.code == 0, r.stderr
        return load_plan(path)


# Plans that exercise every mapping branch (HSDP, ZB-V with an uneven split, CP, DDP + GPipe),
# and the plan verb's own answers for 13B on 16 GPUs and for a pinned 3-D layout.
VARIANTS = {
    "13b": plan_13b,
    "3d": plan_3d,
    "hsdp_offload": lambda: make_plan(32, tp=4, dp_replicate=2, dp_shard=4, zero_stage=3, micro_batch_size=2,
                                      grad_accum_steps=16, offload="optimizer+params"),
    "zbv_uneven": lambda: make_plan(32, tp=8, pp=2, dp_shard=2, zero_stage=2, micro_batch_size=1,
                                    grad_accum_steps=128, pp_schedule="zb-v", virtual_stages=2,
                                    layers_per_stage=(9, 11, 11, 9)),
    "cp": lambda: make_plan(16, tp=4, cp=2, dp_shard=2, zero_stage=3, micro_batch_size=1, grad_accum_steps=128),
    "ddp_gpipe": lambda: make_plan(16, tp=2, pp=4, dp_replicate=2, micro_batch_size=2, grad_accum_steps=64,
                                   pp_schedule="gpipe", recompute="selective"),
    "plan_verb_13b": lambda: plan_verb("--model", "13B", "--gpus", "16"),
    "plan_verb_3d": lambda: plan_verb("--model", "13B", "--gpus", "32", "--tp", "4", "--pp", "4",
                                      "--pp-schedule", "interleaved-1f1b"),
}


# torchtitan builds only the llama3 flavors it registers: the same layouts on llama3-8b (32 layers).
TT_VARIANTS = {
    "8b": lambda: make_plan(16, "llama3-8b", tp=8, dp_shard=2, zero_stage=3, micro_batch_size=1, grad_accum_steps=128),
    "3d": lambda: make_plan(32, "llama3-8b", tp=4, pp=4, dp_shard=2, zero_stage=1, micro_batch_size=1,
                            grad_accum_steps=128, sequence_parallel=True, pp_schedule="interleaved-1f1b",
                            virtual_stages=2, recompute="full"),
    "zbv_uneven": lambda: make_plan(32, "llama3-8b", tp=8, pp=2, dp_shard=2, zero_stage=2, micro_batch_size=1,
                                    grad_accum_steps=128, pp_schedule="zb-v", virtual_stages=2,
                                    layers_per_stage=(7, 9, 9, 7)),
    "cp": lambda: make_plan(16, "llama3-8b", tp=4, cp=2, dp_shard=2, zero_stage=3, micro_batch_size=1,
                            grad_accum_steps=128),
    "ddp_gpipe": lambda: make_plan(16, "llama3-8b", tp=2, pp=4, dp_replicate=2, micro_batch_size=2,
                                   grad_accum_steps=64, pp_schedule="gpipe", recompute="selective"),
    "plan_verb_8b": lambda: plan_verb("--model", "llama3-8b", "--gpus", "16"),
}


@pytest.fixture(params=sorted(VARIANTS))
def plan(request) -> Plan:
    return VARIANTS[request.param]()


@pytest.fixture(params=sorted(TT_VARIANTS))
def tt_plan(request) -> Plan:
    return TT_VARIANTS[request.param]()


def _comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


# ---- torchtitan -------------------------------------------------------------


def test_torchtitan_round_trip(tt_plan):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    plan = tt_plan
    lay = plan.layout
    result = export_plan(plan, "torchtitan")
    cfg = tomllib.loads(result.text)
    assert cfg["model"]["flavor"] == "8B"
    par, tr = cfg["parallelism"], cfg["training"]
    rep, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    if any("refuses DDP" in note for note in result.notes):  # torchtitan 0.2: no DDP next to TP/PP
        assert (rep, shard, par["fsdp_reshard_after_forward"]) == (1, lay.dp, "never")
    else:
        assert (rep, shard) == (lay.dp_replicate, lay.dp_shard)
    assert (par["tensor_parallel_degree"], par["context_parallel_degree"], par["pipeline_parallel_degree"]) == (
        lay.tp, lay.cp, lay.pp)
    assert rep * shard * par["tensor_parallel_degree"] * par["context_parallel_degree"] * par[
        "pipeline_parallel_degree"] == plan.world_size
    # torchtitan's own arithmetic: accumulation = global // (local * dp); PP splits a local batch in microbatches
    local, dp = tr["local_batch_size"], rep * shard
    assert tr["global_batch_size"] % (local * dp) == 0
    accumulation = tr["global_batch_size"] // (local * dp)
    if lay.pp > 1:
        micro = par["pipeline_parallel_microbatch_size"]
        assert local % micro == 0
        # the pipeline schedule gets all of the plan's micro-batches in one step, as meshplan simulated it
        assert (accumulation, local // micro) == (1, lay.grad_accum_steps)
        schedule = get_schedule_class(par["pipeline_parallel_schedule"])  # torch must know the name
        assert issubclass(schedule, PipelineScheduleMulti) == (lay.virtual_stages > 1)
    else:
        micro = local
        assert accumulation == lay.grad_accum_steps
    assert micro * lay.grad_accum_steps * dp == tr["global_batch_size"] == plan.training.global_batch_size
    assert tr["seq_len"] == plan.training.seq_len
    assert cfg["activation_checkpoint"]["mode"] == lay.recompute


@pytest.mark.parametrize("name", ["3d", "zbv_uneven", "ddp_gpipe"])  # the variants with PP
def test_torchtitan_model_parts_cover_every_layer_once_in_order(name):
    plan = TT_VARIANTS[name]()
    parts = tomllib.loads(export_plan(plan, "torchtitan").text)["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == plan.layout.pp * plan.layout.virtual_stages
    layers = [[int(name.split(".")[1]) for name in part if name.startswith("layers.")] for part in parts]
    assert [len(p) for p in layers] == list(plan.layout.layers_per_stage)
    assert sum(layers, []) == list(range(plan.model.n_layers))
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]


def test_torchtitan_zero_stage_maps_to_reshard_policy():
    par = tomllib.loads(export_plan(TT_VARIANTS["8b"](), "torchtitan").text)["parallelism"]
    assert par["fsdp_reshard_after_forward"] == "always"  # ZeRO-3: parameters resharded after forward
    result = export_plan(TT_VARIANTS["3d"](), "torchtitan")
    assert tomllib.loads(result.text)["parallelism"]["fsdp_reshard_after_forward"] == "never"
    assert any("ZeRO-1" in note for note in result.notes)


def test_torchtitan_writes_the_plans_float8_and_compile():
    """An fp8, compiled torchtitan plan exports torchao's tensorwise float8 converter with FSDP float8
    all-gathers (output layer in bf16) and the per-block compile; 0.3's converter has no such recipe."""
    spec = load_model("llama3-8b")
    plan = Plan(model=spec, cluster=load_cluster("dgx-h100", 8), engine="torchtitan",
                training=TrainingSpec(seq_len=262144, global_batch_size=1, precision="fp8", compile=True),
                layout=with_stage_layers(spec, Layout(cp=8, zero_stage=3, recompute="full")))
    result = export_plan(plan, "torchtitan")
    cfg = tomllib.loads(result.text)
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    assert cfg["quantize"]["linear"]["float8"] == {"enable_fsdp_float8_all_gather": True, "filter_fqns": ["output"],
                                                   "precompute_float8_dynamic_scale_for_fsdp": True}
    assert cfg["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert (cfg["parallelism"]["data_parallel_shard_degree"], cfg["parallelism"]["context_parallel_degree"]) == (1, 8)
    assert not any("not written" in note for note in result.notes)
    bf16 = export_plan(dataclasses.replace(plan, training=plan.training.replace(precision="bf16", compile=False)),
                       "torchtitan")
    assert "quantize" not in tomllib.loads(bf16.text) and "compile" not in tomllib.loads(bf16.text)
    module = export_plan(plan, "torchtitan", version="0.3")
    assert "cfg.compile.enable = True" in module.text
    assert any("rowwise recipes only" in note for note in module.notes)


def test_torchtitan_refuses_a_shape_it_does_not_register():
    with pytest.raises(ExportRefused, match="llama2-13b.*none of them"):
        export_plan(plan_13b(), "torchtitan")


def test_torchtitan_03_is_a_python_config_module():
    plan = TT_VARIANTS["3d"]()
    result = export_plan(plan, "torchtitan", version="0.3")
    assert result.filename == "meshplan_llama3_8b.py"
    compile(result.text, result.filename, "exec")  # valid Python
    assert "from torchtitan.models.llama3.config_registry import llama3_8b" in result.text
    assert "cfg.parallelism.tensor_parallel_degree = 4" in result.text and "FullAC.Config()" in result.text
    with pytest.raises(UsageError, match="target-version"):
        export_plan(plan, "torchtitan", version="0.5")


def test_every_note_is_also_in_the_file_comments(plan):
    for target in ("megatron", "accelerate") + (("torchtitan",) if plan.model.name == "llama3-8b" else ()):
        result = export_plan(plan, target)
        comments = _comments(result.text)
        assert "could not express" in comments
        for note in result.notes:
            assert note in comments, (target, note)


# ---- DeepSpeed ----------------------------------------------------------------


def test_deepspeed_batch_identity(plan):
    lay = plan.layout
    result = export_plan(plan, "deepspeed")
    cfg = json.loads(result.text)
    assert cfg["train_batch_size"] == plan.training.global_batch_size
    assert cfg["train_micro_batch_size_per_gpu"] == lay.micro_batch_size
    assert cfg["gradient_accumulation_steps"] == lay.grad_accum_steps
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * lay.dp == cfg[
        "train_batch_size"]
    # DeepSpeed's PipelineEngine takes ZeRO 0-1 only: ZeRO-2/3 with pp is exported as ZeRO-1, with its cost
    # and its engine runs bf16 weights with fp32 gradient accumulation only under ZeRO: ZeRO-0 becomes ZeRO-1
    mix = lay.zero_stage == 0 and plan.training.grad_dtype != plan.training.dtype
    expected = 1 if (lay.pp > 1 and lay.zero_stage >= 2) or mix else lay.zero_stage
    assert cfg["zero_optimization"]["stage"] == expected
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg.get("tensor_parallel", {}).get("autotp_size", 1) == lay.tp
    # DeepSpeed's dp is the world unless the script passes the plan's grid: the export writes it
    files = dict(result.extra_files)
    assert ("meshplan_ds_mpu.py" in files) == (lay.tp * lay.pp * lay.cp > 1)
    if "meshplan_ds_mpu.py" in files:
        assert f"PP, DP, CP, TP = {lay.pp}, {lay.dp}, {lay.cp}, {lay.tp}" in files["meshplan_ds_mpu.py"]


def test_deepspeed_says_clearly_it_cannot_do_tp_and_pp():
    notes = export_plan(plan_3d(), "deepspeed").notes
    assert any(note.startswith("tp 4: plain DeepSpeed has no Megatron-style tensor parallelism") for note in notes)
    assert any(note.startswith("pp 4: a ds_config cannot set pipeline stages") for note in notes)


def test_deepspeed_hsdp_zero3_is_mics_before_0_19_7_and_hpz_after():
    old = json.loads(export_plan(VARIANTS["hsdp_offload"](), "deepspeed", version="0.18.9").text)
    assert old["zero_optimization"]["mics_shard_size"] == 4
    result = export_plan(VARIANTS["hsdp_offload"](), "deepspeed")
    cfg = json.loads(result.text)["zero_optimization"]
    assert "mics_shard_size" not in cfg and cfg["zero_hpz_partition_size"] == 4
    assert any("removed MiCS" in note and "predicted step" in note for note in result.notes)
    assert cfg["offload_optimizer"]["device"] == "cpu" and cfg["offload_param"]["device"] == "cpu"


def test_deepspeed_hostfile_has_one_line_per_node():
    result = export_plan(plan_13b(), "deepspeed", hosts=["node-a", "node-b"])
    text = dict(result.extra_files)["hostfile"]
    rows = [re.fullmatch(r"(\S+) slots=(\d+)", line).groups() for line in text.splitlines()]
    assert [host for host, _ in rows] == ["node-a", "node-b"]
    assert sum(int(slots) for _, slots in rows) == 16
    assert "hostfile" not in dict(export_plan(plan_13b(), "deepspeed").extra_files)


# ---- accelerate ---------------------------------------------------------------


def test_accelerate_round_trip(plan):
    lay = plan.layout
    text = export_plan(plan, "accelerate").text
    cfg = yaml.safe_load(text)
    assert cfg["num_processes"] == plan.world_size and cfg["num_machines"] == plan.cluster.n_nodes
    sizes = cfg.get("parallelism_config", {})
    product = 1
    for key in ("dp_replicate", "dp_shard", "tp", "cp"):
        product *= sizes.get(f"parallelism_config_{key}_size", 1)
    if sizes:
        assert product == cfg["num_processes"]  # accelerate's own check: total_size == num_processes
        assert sizes["parallelism_config_tp_size"] == lay.tp and sizes["parallelism_config_cp_size"] == lay.cp
        # accelerate refuses TP/CP on top of plain DDP
        assert not (max(lay.tp, lay.cp) > 1 and sizes["parallelism_config_dp_replicate_size"] > 1
                    and sizes["parallelism_config_dp_shard_size"] == 1)
    batch = dict(re.findall(r"(\w+)=(\d+)", re.search(r"^# batch: per_device.*$", text, re.M).group(0)))
    b = {k: int(v) for k, v in batch.items()}
    assert b["per_device_batch_size"] * b["gradient_accumulation_steps"] * b["data_parallel_size"] == b[
        "global_batch_size"] == plan.training.global_batch_size
    if sizes:
        assert b["data_parallel_size"] == (sizes["parallelism_config_dp_replicate_size"]
                                           * sizes["parallelism_config_dp_shard_size"])
    if cfg["distributed_type"] == "FSDP":
        assert cfg["fsdp_config"]["fsdp_reshard_after_forward"] == (lay.zero_stage == 3)


def test_accelerate_13b_keeps_the_plan_degrees():
    cfg = yaml.safe_load(export_plan(plan_13b(), "accelerate", hosts=["a", "b"]).text)
    assert cfg["distributed_type"] == "FSDP" and cfg["main_process_ip"] == "a"
    assert cfg["parallelism_config"] == {"parallelism_config_dp_replicate_size": 1,
                                         "parallelism_config_dp_shard_size": 2,
                                         "parallelism_config_tp_size": 8, "parallelism_config_cp_size": 1}


def test_accelerate_folds_pipeline_stages_and_says_so():
    result = export_plan(plan_3d(), "accelerate")
    assert yaml.safe_load(result.text)["parallelism_config"]["parallelism_config_dp_shard_size"] == 8
    assert any(note.startswith("pp 4: accelerate has no pipeline parallelism") for note in result.notes)


# ---- common behaviour -----------------------------------------------------------


def test_export_result_validates_its_fields():
    with pytest.raises(UsageError):
        ExportResult("torchtitan", "x", "")
    with pytest.raises(UsageError):
        ExportResult("nonsense", "x", "f.toml")


def test_unknown_target_and_wrong_host_count_are_usage_errors():
    with pytest.raises(UsageError, match="unknown export target 'megatorn'.*did you mean 'megatron'"):
        export_plan(plan_13b(), "megatorn")
    with pytest.raises(UsageError, match="3 hosts but the plan runs on 2 nodes"):
        export_plan(plan_13b(), "deepspeed", hosts=["a", "b", "c"])
    with pytest.raises(UsageError, match="twice"):
        export_plan(plan_13b(), "deepspeed", hosts=["a", "a"])


def test_every_target_exports_both_issue_plans():
    for build in (plan_13b, plan_3d):
        for target in TARGETS:
            if target == "torchtitan":  # llama2-13b is no flavor torchtitan registers
                with pytest.raises(ExportRefused):
                    export_plan(build(), target)
                continue
            result = export_plan(build(), target)
            assert result.target == target and result.text.strip()


# ---- the TOML writer, against tomllib ----------------------------------------

_scalars = (st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.booleans() | st.text()
            | st.floats(allow_nan=False, allow_infinity=False))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(), st.dictionaries(st.text(), _values, max_size=5), max_size=4))
@example({"0\n": {"k\n": 1}})  # a bare-looking key ending in a newline must be quoted
def test_toml_writer_round_trips_through_tomllib(tables):
    assert tomllib.loads(dumps(tables, header=["a\nheader"], comments={})) == tables


def test_toml_writer_keeps_comments_and_refuses_what_toml_cannot_hold():
    text = dumps({"t": {"k": 1}}, header=["top"], comments={("t", "k"): "why\nthis"})
    assert text.startswith("# top\n") and "k = 1  # why this" in text
    assert tomllib.loads(text) == {"t": {"k": 1}}
    for bad in (float("inf"), float("nan"), None, {"nested": 1}):
        with pytest.raises(UsageError):
            dumps({"t": {"k": bad}})


def test_accelerate_cpu_plan_is_multi_cpu_ddp_with_the_cost():
    plan = Plan(model=load_model("debug"), cluster=load_cluster("cpu", 4),
                training=TrainingSpec(seq_len=256, global_batch_size=16),
                layout=Layout(tp=2, dp_shard=2, zero_stage=3, micro_batch_size=2, grad_accum_steps=4))
    result = export_plan(plan, "accelerate")
    cfg = yaml.safe_load(result.text)
    assert cfg["distributed_type"] == "MULTI_CPU" and cfg["use_cpu"] is True
    assert "parallelism_config" not in cfg and "fsdp_config" not in cfg and cfg["num_processes"] == 4
    assert "gradient_accumulation_steps=2 data_parallel_size=4 global_batch_size=16" in result.text
    assert any("MULTI_CPU" in note and "predicted step" in note for note in result.notes)


def test_accelerate_folded_pipeline_keeps_the_batch_identity_and_says_when_it_moves():
    plan = make_plan(24, tp=4, pp=3, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=128)
    result = export_plan(plan, "accelerate", hosts=["a", "b", "c"])
    line = next(x for x in result.text.splitlines() if x.startswith("# batch: per_device"))
    values = dict(kv.split("=") for kv in line[len("# batch: "):].split())
    micro, accum, dp, batch = (int(values[k]) for k in ("per_device_batch_size", "gradient_accumulation_steps",
                                                          "data_parallel_size", "global_batch_size"))
    assert micro * accum * dp == batch and dp == 6 and batch != 256
    assert any(f"it becomes {batch}" in note for note in result.notes)
    assert "--rdzv_backend c10d" in result.text


def test_deepspeed_pipeline_with_zero2_becomes_zero1_with_the_cost():
    plan = make_plan(16, tp=2, pp=2, dp_shard=4, zero_stage=2, micro_batch_size=2, grad_accum_steps=32)
    result = export_plan(plan, "deepspeed")
    assert json.loads(result.text)["zero_optimization"]["stage"] == 1
    assert any(note.startswith("ZeRO-2 with pp 2") and "predicted step" in note for note in result.notes)
    mpu = dict(result.extra_files)["meshplan_ds_mpu.py"]
    assert "PP, DP, CP, TP = 2, 4, 1, 2" in mpu
