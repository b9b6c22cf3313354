"""The family-level search (planner.search.families) against the searches it must agree with.

References, independent of planner.search.families and planner.search.search:
`_flat_search` bounds every candidate of the whole space first and expands
them in bound order (the exact branch-and-bound the family levels shortcut);
`_exhaustive` simulates every candidate at its lightest fitting recomputation.
The search must return the same layouts, step times and peak memory.
"""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from planner.engines import get_engine
from planner.layout import divisors, partial_recompute_options
from planner.model.load import load_model
from planner.plan import with_stage_layers
from planner.search.bound import StepBound
from planner.search.candidates import Pins, pipeline_allows, shapes
from planner.search.families import FamilyBounds, build_families
from planner.search.search import USABLE_MEMORY_FRACTION, Scored, _Context, search
from planner.simulate.calibration import load_calibration
from planner.simulate.comm import expert_grid_key, representative_expert_groups
from planner.simulate.step import simulate_step, step_memory
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster


def _cluster(gpus):
    return load_cluster("dgx-h100", gpus)


def _levels(model, layout, engine):
    """Recompute levels from lightest to heaviest, partial full recomputation before full (as the search orders)."""
    eng = get_engine(engine)
    out = []
    for kind in eng.recompute_kinds:
        if kind == "full":
            extra = partial_recompute_options(model.n_layers, layout.pp, layout.virtual_stages) \
                if eng.partial_recompute else ()
            out += [("full", n) for n in extra] + [("full", 0)]
        else:
            out.append((kind, 0))
    return out


def _leaves(model, cluster, training, engine, pins):
    """(enumeration position, shape, micro-batch) of every candidate the engine accepts."""
    eng = get_engine(engine)
    overlapped = "dualpipev" in eng.pp_schedules  # the search proposes DualPipeV to the engines that run it
    for i, shape in enumerate(shapes(cluster.world_size, model, training.seq_len, pins, "none",
                                     overlapped=overlapped)):
        if training.global_batch_size % shape.dp or eng.refusal(model, shape, training.dtype, True, training):
            continue
        per = training.global_batch_size // shape.dp
        for mb in divisors(per):
            if pipeline_allows(shape, per // mb):
                yield i, shape, mb


def _fit(model, cluster, training, engine, cal, shape, mb, levels):
    """The shape at this micro-batch with the lightest recomputation that fits, or None."""
    cap = int(cluster.gpu.memory_bytes * USABLE_MEMORY_FRACTION)
    per = training.global_batch_size // shape.dp
    for kind, n in levels:
        layout = shape.replace(micro_batch_size=mb, grad_accum_steps=per // mb, recompute=kind, recompute_layers=n)
        if step_memory(model, training, layout, cluster, cal, engine).peak_bytes <= cap:
            return layout
    return None


def _scored(model, cluster, training, engine, cal, layout):
    layout = with_stage_layers(model, layout)
    return Scored(layout, training, simulate_step(model, training, layout, cluster, cal, engine=engine))


def _flat_search(model, cluster, training, engine, pins, top_k):
    """Every candidate bounded at its lightest level, expanded in bound order until none can enter the top k."""
    cal = load_calibration(None, cluster.gpu)
    bound = StepBound(model, cluster, cal, engine)
    queue = []
    for i, shape, mb in _leaves(model, cluster, training, engine, pins):
        levels = _levels(model, shape, engine)
        seconds = bound.for_shape(shape, training).seconds(mb, levels[0]) / training.tokens_per_step
        queue.append((seconds, i, mb, shape, levels, 0))
    heapq.heapify(queue)
    best = []
    while queue:
        seconds, i, mb, shape, levels, level = heapq.heappop(queue)
        if len(best) == top_k and seconds > best[-1].seconds_per_token:
            break
        layout = _fit(model, cluster, training, engine, cal, shape, mb, levels[level:])
        if layout is None:
            continue
        found = levels.index((layout.recompute, layout.recompute_layers))
        if found != level:  # back in the queue with the bound of the recomputation it needs
            again = bound.for_shape(shape, training).seconds(mb, levels[found]) / training.tokens_per_step
            heapq.heappush(queue, (again, i, mb, shape, levels, found))
            continue
        best = sorted([*best, _scored(model, cluster, training, engine, cal, layout)], key=lambda s: s.key)[:top_k]
    return best


def _exhaustive(model, cluster, training, engine, pins):
    """Every candidate simulated at its lightest fitting recomputation, best first."""
    cal = load_calibration(None, cluster.gpu)
    out = []
    for _, shape, mb in _leaves(model, cluster, training, engine, pins):
        layout = _fit(model, cluster, training, engine, cal, shape, mb, _levels(model, shape, engine))
        if layout is not None:
            out.append(_scored(model, cluster, training, engine, cal, layout))
    return sorted(out, key=lambda s: s.key)


def _same(ranked, reference):
    assert [(s.layout, s.result.step_time_s, s.result.memory.peak_bytes) for s in ranked] == \
        [(s.layout, s.result.step_time_s, s.result.memory.peak_bytes) for s in reference]


@pytest.mark.parametrize("name, gpus, engine", [("8B", 256, "megatron"), ("mixtral-8x7b", 256, "megatron"),
                                                ("qwen3-30b-a3b", 64, "torchtitan")])
def test_the_search_returns_what_the_flat_search_returns(name, gpus, engine):
    """Whole spaces of a few hundred GPUs (every schedule, split, ZeRO stage, ep and etp), refusals included."""
    model, cluster = load_model(name), _cluster(gpus)
    training = TrainingSpec(2048, 512)
    result = search(model, cluster, 2048, 512, engine=engine, top_k=5)
    assert len(result.ranked) == 5
    _same(result.ranked, _flat_search(model, cluster, training, engine, Pins(), 5))


@pytest.mark.parametrize("name, pins", [("8B", Pins(tp=2, pp=4, cp=1)), ("qwen3-30b-a3b", Pins(tp=2, pp=4, cp=1))])
def test_the_search_returns_the_exhaustive_top(name, pins):
    """Every candidate of a pinned space on 256 GPUs simulated: the search's top 5 is the exhaustive top 5."""
    model, cluster = load_model(name), _cluster(256)
    training = TrainingSpec(2048, 128)
    every = _exhaustive(model, cluster, training, "megatron", pins)
    result = search(model, cluster, 2048, 128, pins, engine="megatron", top_k=5)
    assert result.stats.simulated < len(every)
    _same(result.ranked, every[:5])


@pytest.mark.parametrize("name, gpus, engine", [("8B", 512, "megatron"), ("mixtral-8x7b", 64, "megatron"),
                                                ("llama3-70b", 256, "torchtitan")])
def test_family_and_member_bounds_never_exceed_a_candidate_bound(name, gpus, engine):
    """Level 1 <= level 2 <= level 3 <= simulated step, for every family and micro-batch of the space (simulated
    on a sample)."""
    model, cluster = load_model(name), _cluster(gpus)
    cal = load_calibration(None, cluster.gpu)
    ctx = _Context(model=model, cluster=cluster, seq_len=2048, target_batch=512, batch_fixed=True, pins=Pins(),
                   engine=engine, calibration=cal, bound=StepBound(model, cluster, cal, engine))
    bounds = FamilyBounds(ctx, "none")
    rng = random.Random(0)
    simulated = 0
    for fam in build_families(ctx, "none"):
        for mb in fam.micro_batches:
            level = _levels(model, fam.group.layout(fam.group.splits[0], fam.schedule, "none"), engine)[0]
            members = bounds.members(fam, mb, level)
            assert bounds.family(fam, mb, level) <= members.min()
            for j, member in zip(fam.members, members.tolist(), strict=True):
                shape = bounds.shape(fam, j)
                if shape is None:
                    continue
                candidate = shape.bound.seconds(mb, level) / fam.training.tokens_per_step
                assert member <= candidate
                if rng.random() < 0.002:
                    layout = shape.layout.replace(micro_batch_size=mb, grad_accum_steps=fam.per_replica // mb,
                                                  recompute=level[0], recompute_layers=level[1])
                    step = simulate_step(model, fam.training, with_stage_layers(model, layout), cluster, cal,
                                         engine=engine).step_time_s
                    assert candidate * fam.training.tokens_per_step <= step * (1 + 1e-9)
                    simulated += 1
    assert simulated > 10


@pytest.mark.parametrize("gpus_per_node", [4, 8, 72])
def test_expert_groups_depend_only_on_the_expert_grid_key(gpus_per_node):
    """Meshes with the same key (planner.simulate.comm.expert_grid_key) have the same "ep" and "etp" groups."""
    seen = {}
    for pp in (1, 2, 4, 8, 16):
        for replicate in (1, 2, 4, 8):
            for shard, cp, tp in ((8, 1, 2), (4, 2, 2), (16, 1, 1), (2, 2, 4)):
                for ep, etp in ((4, 1), (8, 2), (2, 4), (16, 1)):
                    if (shard * cp * tp) % (ep * etp):
                        continue
                    shape = (pp, replicate, shard, cp, tp)
                    groups = tuple(representative_expert_groups(shape, ep, etp, kind, gpus_per_node)
                                   for kind in ("ep", "etp"))
                    key = expert_grid_key(shape, ep, etp, gpus_per_node)
                    assert seen.setdefault(key, groups) == groups, (shape, ep, etp)
    assert len(seen) < 80  # far fewer keys than meshes


def test_vectorized_member_bounds_match_one_by_one():
    """StepBound.relaxed on numpy arrays of terms gives, member by member, what it gives on floats."""
    model, cluster = load_model("mixtral-8x7b"), _cluster(256)
    cal = load_calibration(None, cluster.gpu)
    bound = StepBound(model, cluster, cal, "megatron")
    training = TrainingSpec(2048, 512)
    units = np.array([[1e-3, 2e-3, 1e-4, 5e-5], [8e-4, 1.5e-3, 2e-4, 0.0]])
    fsdp, expert = (np.array([0.0, 2e-3]), np.array([0.0, 4e-3])), np.array([3e-4, 1e-4])
    for pipeline in ((4, "1f1b", 1), (4, "interleaved-1f1b", 2), (4, "zb-v", 2), (2, "gpipe", 1)):
        scales = np.array([[1.0, 2.0], [1.5, 3.5]])
        arrays = bound.relaxed(tuple(units.T), fsdp, expert, tuple(scales.T), training, 2, ("none", 0), pipeline, 2,
                               1, 64, np.maximum)
        one_by_one = [bound.relaxed(tuple(units[i]), (fsdp[0][i], fsdp[1][i]), expert[i], tuple(scales[i]), training,
                                    2, ("none", 0), pipeline, 2, 1, 64) for i in range(2)]
        assert arrays.tolist() == one_by_one
