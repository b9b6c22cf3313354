"""Pipeline schedules and ZeRO stages an engine runs with pp > 1 (Engine.pp_schedules, pipeline_zero_max):
Megatron-Core has 1F1B with or without interleaving, DeepSpeed's PipelineEngine its TrainSchedule under
ZeRO 0/1; the search never recommends what the engine cannot run."""

from __future__ import annotations

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.model.load import load_model
from planner.search.candidates import Pins
from planner.search.search import search
from topologies.cluster_load import load_cluster

MODEL = load_model("13B")


@pytest.mark.parametrize("engine,schedule,v,refused", [
    ("megatron", "zb-v", 2, True), ("megatron", "gpipe", 1, True), ("megatron", "interleaved-1f1b", 2, False),
    ("deepspeed", "interleaved-1f1b", 2, True), ("deepspeed", "1f1b", 1, False),
    ("torchtitan", "zb-v", 2, False), ("meshplan", "gpipe", 1, False),
])
def test_schedules_each_engine_runs(engine, schedule, v, refused):
    layout = Layout(pp=2, dp_replicate=4, grad_accum_steps=8, pp_schedule=schedule, virtual_stages=v)
    reason = get_engine(engine).refusal(MODEL, layout, "bf16", True)
    assert (reason is not None) == refused
    if refused:
        assert f"pp_schedule {schedule!r}" in reason and "--pp-schedule" in reason


def test_deepspeed_pipelines_only_under_zero_0_or_1():
    engine = get_engine("deepspeed")
    piped = Layout(pp=2, dp_shard=4, zero_stage=2, grad_accum_steps=8)
    assert "ZeRO-2 with pp 2" in engine.refusal(MODEL, piped, "bf16", True)
    assert engine.refusal(MODEL, Layout(pp=1, dp_shard=8, zero_stage=3), "bf16", True) is None


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_search_recommends_only_what_the_engine_runs(engine):
    result = search(MODEL, load_cluster("dgx-h100", 16), 4096, 256, Pins(pp=2), engine, top_k=5)
    eng = get_engine(engine)
    assert result.ranked
    for ranked in result.ranked:
        assert ranked.layout.pp_schedule in eng.pp_schedules
        assert ranked.layout.zero_stage <= eng.pipeline_zero_max
