"""The engine interface (planner.engines): releases, the mechanisms' fields, the rules written once."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from planner.engines import ENGINE_CHOICES, ENGINE_NAMES, ENGINES, Engine, get_engine, newest
from planner.engines import mechanisms as mech
from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.model.load import load_model
from planner.plan import Plan
from planner.search.search import search
from planner.training import TrainingSpec, parse_recipe
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError, UsageError
from topologies.hardware import GIB, get_gpu

REPO = Path(__file__).resolve().parents[2]
LLAMA8 = load_model("llama3-8b")
H100 = get_gpu("h100-sxm")
BF16 = TrainingSpec(seq_len=4096, global_batch_size=8)


def _every_engine() -> list[Engine]:
    return [e for releases in ENGINES.values() for e in releases.values()]


def test_names_and_releases_resolve():
    assert ENGINE_NAMES == ("meshplan", "megatron", "torchtitan", "deepspeed")
    assert get_engine("torchtitan@2025-06").label == "torchtitan@2025-06"
    assert get_engine("megatron@core-0.16") is get_engine("megatron") is newest("megatron")
    assert {"torchtitan@2025-06", "megatron@core-0.16", "megatron@2022", "deepspeed@0.5.3"} <= set(ENGINE_CHOICES)
    engine = get_engine("deepspeed@0.6")
    assert get_engine(engine) is engine
    with pytest.raises(PlanError, match=r"no release '2019' modelled; releases: 2021, 2022, core-0\.7"):
        get_engine("megatron@2019")
    with pytest.raises(PlanError, match="engine must be one of"):
        get_engine("nemo")


def test_plan_help_lists_the_releases():
    from click.testing import CliRunner

    from planner.cli.plan import plan

    text = CliRunner().invoke(plan, ["--help"], terminal_width=200).output
    for label in ("torchtitan@2024-04|2024-12|2025-06", "megatron@2021|2022|core-0.7", "deepspeed@0.5.3|0.6"):
        assert label in re.sub(r"\s+", "", text).replace("torchtitan@", "torchtitan@"), label


def test_plan_json_records_the_release():
    cluster = load_cluster("dgx-h100", 8)
    layout = Layout(dp_shard=8, zero_stage=3)
    plan = Plan(LLAMA8, cluster, BF16, layout, engine="torchtitan@2025-06")
    data = plan.to_json()
    assert (data["engine"], data["engine_release"]) == ("torchtitan", "2025-06")
    assert Plan.from_json(data).engine == "torchtitan@2025-06"
    old = {k: v for k, v in data.items() if k != "engine_release"}  # written before releases: the newest
    assert get_engine(Plan.from_json(old).engine) is newest("torchtitan")
    with pytest.raises(PlanError, match="no release"):
        Plan.from_json({**data, "engine_release": "1999-01"})


def _bool_fields(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), bool)]


def _mechanisms(engine: Engine):
    for f in dataclasses.fields(engine):
        value = getattr(engine, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield f.name, value


def test_no_boolean_is_true_for_no_engine_or_false_for_every_engine():
    """Every boolean of the interface and of its mechanisms separates releases: true for some, false for
    others. A boolean true nowhere is dead; one true everywhere is a constant, not a difference."""
    engines = _every_engine()
    seen: dict[str, set[bool]] = {}
    for e in engines:
        for name in _bool_fields(e):
            seen.setdefault(name, set()).add(getattr(e, name))
        for kind, value in _mechanisms(e):
            for name in _bool_fields(value):
                seen.setdefault(f"{kind}.{name}", set()).add(getattr(value, name))
    constant = {name: values for name, values in seen.items() if len(values) < 2}
    assert not constant, constant


def test_every_mechanism_field_is_read_outside_the_engines():
    """Each field of the mechanisms is read by the memory model, the simulator, the search or the CLI."""
    sources = "\n".join(p.read_text() for folder in ("planner", "executor") for p in (REPO / folder).rglob("*.py")
                        if "engines" not in p.relative_to(REPO).parts)
    sources += (REPO / "planner" / "engines" / "base.py").read_text()  # the rules the interface writes once
    mechanisms = (mech.DataParallel, mech.TensorParallel, mech.Loss, mech.Pipeline, mech.ContextParallel,
                  mech.ModelCode, mech.Experts)
    unread = [f"{cls.__name__}.{f.name}" for cls in mechanisms for f in dataclasses.fields(cls)
              if f.name != "name" and not re.search(rf"\.{f.name}\b", sources)]
    assert not unread


def test_autocast_is_one_rule_the_executor_imports():
    """PyTorch engines autocast where no FSDP2 module casts (path none or ddp); engines storing 16-bit
    parameters never do. executor.parallel.parallelize asks the meshplan engine, not a copy of the rule."""
    meshplan = get_engine("meshplan")
    assert meshplan.autocast(Layout(), 2) and meshplan.autocast(Layout(dp_replicate=8), 2)
    assert not meshplan.autocast(Layout(tp=2, dp_replicate=4), 2)  # FSDP2's replicate casts
    assert not meshplan.autocast(Layout(dp_shard=8, zero_stage=3), 2) and not meshplan.autocast(Layout(), 4)
    assert not get_engine("megatron").autocast(Layout(), 2)
    text = (REPO / "executor" / "parallel" / "parallelize.py").read_text()
    assert "EXECUTOR.autocast(" in text and 'in ("none", "ddp")' not in text


@pytest.mark.parametrize("release,path,autocast", [
    ("2024-12", "ddp", None),  # DDP, no AMP yet: bf16 refused (it would train in fp32)
    ("2025-10", "ddp", True),  # AMP for DDP (0b44d4c)
    ("2026-03", "replicate", False),  # FSDP2's replicate with a MixedPrecisionPolicy
    ("2026-04", "fsdp", False),  # fully_shard at every degree
])
def test_torchtitan_zero0_data_parallel_by_release(release, path, autocast):
    engine = get_engine(f"torchtitan@{release}")
    layout = Layout(dp_replicate=8)
    assert engine.dp_path(layout) == path
    reason = engine.refusal(LLAMA8, layout, "bf16", True, BF16)
    assert (reason is not None) == (autocast is None)
    if autocast is not None:
        assert engine.autocast(layout, 2) == autocast


def test_ddp_bucket_copies_only_where_the_release_runs_ddp():
    """torch DDP keeps bucket copies of every fp32 gradient (gradient_as_bucket_view=False): 4 B per
    parameter, 29.9 GiB for Llama 3 8B; torchtitan's DDP (to 2026-02) does too, FSDP2's paths do not."""
    layout = Layout(dp_replicate=8, micro_batch_size=1, grad_accum_steps=1)
    training = TrainingSpec(seq_len=4096, global_batch_size=8)
    comm = {}
    for spec in ("meshplan", "torchtitan@2025-10", "torchtitan@2026-03", "torchtitan"):
        estimate = estimate_memory(LLAMA8, training, layout, H100, spec)
        comm[spec] = estimate.phases["optimizer_step"]["comm_buffers"]
    buckets = 4 * LLAMA8.total_params
    assert comm["meshplan"] == comm["torchtitan@2025-10"] == pytest.approx(buckets, rel=0.01)
    assert buckets / GIB == pytest.approx(29.9, abs=0.1)
    assert comm["torchtitan@2026-03"] == comm["torchtitan"] == 0


def test_torchtitan_refuses_what_its_release_does_not_run():
    old = get_engine("torchtitan@2025-06")
    why = old.refusal(LLAMA8, Layout(tp=2, dp_replicate=4, sequence_parallel=True), "bf16", True, BF16)
    assert "DDP has not supported > 1D parallelism" in why
    assert "--zero 2 or 3" in old.refusal(LLAMA8, Layout(cp=2, dp_replicate=4), "bf16", True, BF16)
    assert get_engine("torchtitan").refusal(LLAMA8, Layout(tp=2, dp_replicate=4, sequence_parallel=True), "bf16",
                                            True, BF16) is None


def test_older_megatron_releases_refuse_what_they_lack():
    fp8 = BF16.replace(precision="fp8")
    m2022 = get_engine("megatron@2022")
    assert "no 8-bit GEMM recipe" in m2022.refusal(LLAMA8, Layout(), "bf16", True, fp8)
    assert "no context parallelism" in m2022.refusal(LLAMA8, Layout(cp=2, dp_replicate=2), "bf16", True, BF16)
    assert "ZeRO-3" in get_engine("megatron@core-0.11").refusal(LLAMA8, Layout(dp_shard=8, zero_stage=3), "bf16",
                                                               True, BF16)
    assert get_engine("megatron@core-0.12").refusal(LLAMA8, Layout(dp_shard=8, zero_stage=3), "bf16", True,
                                                    BF16) is None
    assert "fp8_params" in get_engine("megatron@core-0.8").refusal(
        LLAMA8, Layout(dp_shard=8, zero_stage=1), "bf16", True, fp8.replace(fp8_params=True))


def test_userbuffers_configs_are_named_recipe_options_per_release():
    """NeMo's and Megatron-Bridge's userbuffers configs of the same name differ (the Bridge moved the
    forward reduce-scatters to ring exchange): the release picks the table."""
    name = "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"
    training = BF16.replace(async_tp=True, tp_overlap_cfg=name)
    nemo, bridge = get_engine("megatron@core-0.12").tp_overlap_sms(training), get_engine("megatron").tp_overlap_sms(training)
    assert nemo.fprop_rs[0].sms == 24 and bridge.fprop_rs[0].sms == 1
    assert parse_recipe(["tp_overlap_cfg=" + name, "grad_dtype=bf16"]) == {"tp_overlap_cfg": name, "grad_dtype": "bf16"}
    assert "no userbuffers config 'nope'" in get_engine("megatron").refusal(
        LLAMA8, Layout(), "bf16", True, BF16.replace(tp_overlap_cfg="nope"))
    with pytest.raises(UsageError, match="grad_dtype takes bf16, fp16, fp32"):
        parse_recipe(["grad_dtype=fp8"])


def test_search_runs_on_an_older_release():
    cluster = load_cluster("dgx-a100-80g", 16)
    result = search(load_model("7B"), cluster, 2048, 64, engine="megatron@2021", top_k=1)
    assert result.best is not None
    best = result.best.layout
    assert best.zero_stage == 0 and not best.sequence_parallel and best.recompute in ("none", "full")


def test_fewer_micro_batches_than_stages_by_pipeline():
    """torch.distributed.pipelining (meshplan, torchtitan) refuses 1F1B with fewer micro-batches than stages;
    Megatron's and DeepSpeed's schedules run them; interleaved 1F1B runs groups of pp on every engine."""
    short = Layout(pp=4, dp_replicate=4, micro_batch_size=1, grad_accum_steps=2, layers_per_stage=(8, 8, 8, 8))
    assert "at least pp (4) micro-batches per step, got grad_accum_steps 2" in get_engine("meshplan").microbatch_refusal(short)
    assert get_engine("torchtitan").microbatch_refusal(short)
    assert get_engine("megatron").microbatch_refusal(short) is None
    assert get_engine("deepspeed").microbatch_refusal(short) is None
    assert get_engine("meshplan").microbatch_refusal(dataclasses.replace(short, grad_accum_steps=4)) is None
    inter = dataclasses.replace(short, pp_schedule="interleaved-1f1b", virtual_stages=2, grad_accum_steps=6,
                                layers_per_stage=(4,) * 8)
    assert get_engine("megatron").microbatch_refusal(inter)  # 6 is not a multiple of pp 4
    assert get_engine("megatron").microbatch_refusal(dataclasses.replace(inter, grad_accum_steps=8)) is None
