"""The memory the search checks is the memory plan.json reports, for every engine.

The search prunes with `planner.simulate.step.step_memory`; the prediction's
memory comes from `simulate_step`. If the two called the memory model with
different arguments (attention kernel, stage split, fixed overhead), the
search would prune layouts its own prediction calls feasible.
"""

from __future__ import annotations

import itertools

import pytest

import planner.search.search as search_module
from planner.engines import ENGINE_NAMES, get_engine
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import with_stage_layers
from planner.search.candidates import Pins
from planner.search.explain import build_plan
from planner.simulate.step import simulate_step, step_memory
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster


def _grid(world: int):
    """Layouts of `world` ranks over tp, pp, cp, ZeRO, recompute and schedule."""
    for tp, pp, cp, zero, rc, sched in itertools.product((1, 2), (1, 2), (1, 2), (0, 1, 3), ("none", "full"),
                                                          ("1f1b", "interleaved-1f1b")):
        dp = world // (tp * pp * cp)
        if sched != "1f1b" and pp == 1:
            continue
        v = 2 if sched == "interleaved-1f1b" else 1
        accum = 4
        zero = zero if dp > 1 else 0
        shard = {"dp_shard": dp} if zero else {"dp_replicate": dp}
        yield Layout(tp=tp, pp=pp, cp=cp, **shard, zero_stage=zero, pp_schedule=sched,
                     virtual_stages=v, micro_batch_size=1, grad_accum_steps=accum, recompute=rc)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_step_memory_is_the_prediction_memory_over_a_grid(engine):
    model, cluster = load_model("7B"), load_cluster("dgx-h100", 16)
    checked = 0
    for layout in _grid(cluster.world_size):
        training = TrainingSpec(2048, layout.dp * layout.micro_batch_size * layout.grad_accum_steps)
        searched = step_memory(model, training, layout, cluster, engine=engine)
        predicted = simulate_step(model, training, with_stage_layers(model, layout), cluster, engine=engine).memory
        assert searched.peak_bytes == predicted.peak_bytes, layout
        checked += 1
    assert checked >= 40


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("pins", [Pins(), Pins(tp=1), Pins(pp=2)], ids=["free", "tp1", "pp2"])
def test_search_checked_memory_equals_plan_json_peak(engine, pins, monkeypatch):
    """Spy on the search's own memory calls and compare them with every ranked layout's plan.json peak."""
    seen: dict[tuple, int] = {}
    real = search_module.step_memory

    def spy(model, training, layout, *args, **kwargs):
        est = real(model, training, layout, *args, **kwargs)
        seen[(layout.replace(layers_per_stage=()), training)] = est.peak_bytes
        return est

    monkeypatch.setattr(search_module, "step_memory", spy)
    model, cluster = load_model("13B"), load_cluster("dgx-h100", 16)
    result = search_module.search(model, cluster, 4096, pins=pins, engine=engine, top_k=8)
    assert result.ranked, "the 13B model fits 16 H100 under every engine"
    for scored in result.ranked:
        key = (scored.layout.replace(layers_per_stage=()), scored.training)
        assert key in seen, f"the search ranked {scored.layout} without checking its memory"
        assert seen[key] == scored.result.memory.peak_bytes
    plan = build_plan(model, cluster, result, engine).to_json()
    best = result.best
    assert plan["prediction"]["peak_memory_bytes"] == seen[(best.layout.replace(layers_per_stage=()), best.training)]


def test_megatron_llama3_8b_cp2_fits_80gb():
    """Megatron-Core's fused attention: Llama 3.1 8B, seq 8192, tp 1 cp 2, no recompute, on 32 H100 fits 80 GB.

    NVIDIA's NeMo recipe runs this layout on 80 GB H100s; with eager attention
    the scores of 8192x8192 per head would not fit.
    """
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", 32)
    pins = Pins(tp=1, cp=2, recompute="none")
    result = search_module.search(model, cluster, 8192, pins=pins, engine="megatron", top_k=1)
    assert result.ranked, result.near_miss
    best = result.best
    assert (best.layout.tp, best.layout.cp, best.layout.recompute) == (1, 2, "none")
    assert best.result.memory.peak_bytes < 80e9
    eager = step_memory(model, best.training.replace(attention="eager"), best.layout, cluster, engine="megatron")
    assert eager.peak_bytes > best.result.memory.peak_bytes


@pytest.mark.parametrize("model_name,gpus,engine", [("13B", 16, "meshplan"), ("70B", 64, "megatron"),
                                                    ("8B", 8, "torchtitan@2025-10"), ("70B", 64, "deepspeed"),
                                                    ("mixtral-8x7b", 16, "meshplan")])
def test_the_memory_floor_is_never_above_the_estimate(model_name, gpus, engine, monkeypatch):
    """The search rules candidates out by planner.memory.floors.peak_floor_bytes before estimating them:
    on every layout it estimates, the floor is at or below the estimate (and not a loose one)."""
    from planner.memory.floors import peak_floor_bytes, stage_state_floors

    ratios = []
    real = search_module.step_memory

    def checked(model, training, layout, cluster, calibration, eng):
        memory = real(model, training, layout, cluster, calibration, eng)
        floors = stage_state_floors(model, training, layout, eng, cluster.gpu.fp8_any_layout)
        floor = peak_floor_bytes(model, training, layout, eng, memory.other_bytes, floors)
        assert floor <= memory.peak_bytes, (layout, floor, memory.peak_bytes)
        ratios.append(floor / memory.peak_bytes)
        return memory

    monkeypatch.setattr(search_module, "step_memory", checked)
    model = load_model(model_name)
    result = search_module.search(model, load_cluster("dgx-h100", gpus), min(model.max_seq_len, 4096), engine=engine)
    assert result.ranked and len(ratios) > 50
    assert max(ratios) > 0.8  # tight where it matters: near the GPU's capacity


@pytest.mark.parametrize("model_name,gpus,engine,seq", [
    ("405B", 128, "meshplan", 4096), ("70B", 32, "megatron", 4096), ("70B", 32, "deepspeed", 4096),
    ("8B", 8, "torchtitan@2025-10", 8192), ("mixtral-8x7b", 16, "meshplan", 4096),
    ("kimi-k2", 256, "megatron", 4096)])
def test_the_state_floor_of_every_member_is_never_above_its_model_states(model_name, gpus, engine, seq):
    """The search drops the members of a family whose model states cannot fit (FamilyBounds.states_may_fit,
    from planner.memory.states.state_floor_bytes) before it builds them: each dropped member's exact model
    states (stage_state_floors, what the search's own check reads) do not fit either, and the floor drops
    some members, so it is not idle."""
    from planner.memory.floors import stage_state_floors
    from planner.search.bound import StepBound
    from planner.search.families import FamilyBounds, build_families
    from planner.search.search import _Context
    from planner.simulate.calibration import load_calibration

    model, cluster = load_model(model_name), load_cluster("dgx-h100", gpus)
    calibration = load_calibration(None, cluster.gpu)
    ctx = _Context(model=model, cluster=cluster, seq_len=seq, target_batch=gpus * 4, batch_fixed=False,
                   pins=Pins(), engine=engine, calibration=calibration,
                   bound=StepBound(model, cluster, calibration, engine))
    families, bounds = build_families(ctx, "none"), FamilyBounds(ctx, "none")
    dropped = kept = 0
    for fam in families[::max(1, len(families) // 40)]:
        fits = bounds.states_may_fit(fam)
        for j, may in enumerate(fits.tolist()):
            layout = fam.group.layout(fam.group.splits[j], fam.schedule, "none")
            if get_engine(engine).refusal(model, layout, "bf16", True, fam.training):
                continue  # never built, never memory-checked
            exact = max(t for _, _, t in stage_state_floors(model, fam.training, layout, engine).values())
            if not may:
                dropped += 1
                assert exact + ctx.other_bytes > ctx.capacity_bytes, layout
            kept += may
    assert dropped > 0 and kept > 0
