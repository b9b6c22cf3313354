"""Explanations: why the winner wins, why each runner-up lost, why nothing fits.

Every sentence is computed from the simulated numbers (time breakdowns,
memory breakdowns, the layouts' differences), never canned: a reader should
be able to check each claim against the table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planner.accuracy.bands import band_words, uncertainty_json
from planner.engines import get_engine
from planner.figures import percent, seconds, sig, thousands
from planner.layout import Layout, recompute_fields, recompute_label
from planner.model.context import long_context_sentence
from planner.model.spec import ModelSpec
from planner.plan import Plan
from planner.search.advice import (
    BubbleSplit,
    Context,
    best_suggestion,
    bubble_split,
    chunk_words,
    larger_batch_options,
    wider_dp_options,
)
from planner.search.candidates import Pins
from planner.search.search import NearMiss, Scored, SearchResult
from planner.simulate.step import step_memory
from topologies.cluster import Cluster
from topologies.errors import InfeasibleError, MeshplanError, PlanError
from topologies.hardware import GIB

# Layout fields a reader compares, in the order the table shows them.
COMPARED = ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep", "etp", "zero_stage", "micro_batch_size", "recompute",
            "sequence_parallel", "pp_schedule", "virtual_stages", "offload")
# time_breakdown_s entries that are parts of the step (others are sub-totals or details).
STEP_PARTS = ("compute", "exposed_comm", "bubble", "optimizer")
PART_WORDS = {"compute": "compute", "exposed_comm": "exposed communication", "bubble": "pipeline bubble",
              "optimizer": "optimizer step"}


def describe(layout: Layout) -> str:
    """A short one-line name of a layout, e.g. 'tp 8 x pp 2 x dp 1, ZeRO-0, mb 1, 1f1b'."""
    dp = f"dp {layout.dp}" if not layout.hsdp else f"dp {layout.dp_replicate}x{layout.dp_shard}"
    parts = [f"tp {layout.tp}", f"pp {layout.pp}", dp]
    if layout.cp > 1:
        parts.append(f"cp {layout.cp}")
    text = " x ".join(parts) + _experts(layout) + f", ZeRO-{layout.zero_stage}, micro-batch {layout.micro_batch_size}"
    if layout.recompute != "none":
        text += f", {layout.recompute} recompute" + (
            f" of {layout.recompute_layers} layers per chunk" if layout.recompute_layers else "") + (
            f" ({', '.join(layout.recompute_modules)})" if layout.recompute_modules else "")
    if layout.pp > 1:
        text += f", {layout.pp_schedule}" + (f" v{layout.virtual_stages}" if layout.virtual_stages > 1 else "")
    if layout.offload != "none":
        text += f", offload {layout.offload}"
    return text


def _experts(layout: Layout) -> str:
    """The expert grid of a MoE layout (planner.layout), empty for a dense one."""
    if layout.ep * layout.etp == 1:
        return ""
    return f" (experts: ep {layout.ep}, etp {layout.etp}, edp {layout.edp})"


FIELD_WORDS = {"zero_stage": "ZeRO-", "micro_batch_size": "micro-batch ", "dp_replicate": "dp_replicate ",
               "dp_shard": "dp_shard ", "pp_schedule": "schedule ", "virtual_stages": "virtual stages ",
               "sequence_parallel": "sequence parallel "}


def short(layout: Layout) -> str:
    """A compact layout name for narrow tables, e.g. 'tp8 pp2 dp4 Z1 mb1x16 1f1b'."""
    dp = f"dp{layout.dp}" if not layout.hsdp else f"dp{layout.dp_replicate}x{layout.dp_shard}"
    text = f"tp{layout.tp} pp{layout.pp} {dp}" + (f" cp{layout.cp}" if layout.cp > 1 else "")
    text += f" ep{layout.ep}" + (f"/etp{layout.etp}" if layout.etp > 1 else "") if layout.ep * layout.etp > 1 else ""
    text += f" Z{layout.zero_stage}" + ({"optimizer": "+off-opt", "optimizer+params": "+off-params"}
                                        .get(layout.offload, ""))
    text += f" mb{layout.micro_batch_size}x{layout.grad_accum_steps}"
    if layout.recompute != "none":
        text += f" rc-{recompute_label(layout)}"
    if layout.pp > 1:
        text += f" {layout.pp_schedule}" + (f"/v{layout.virtual_stages}" if layout.virtual_stages > 1 else "")
    return text


def layout_diff(a: Layout, b: Layout) -> str:
    """The fields where `a` differs from `b`, as 'tp 4 (not 8), ZeRO-3 (not 1)'."""
    out = []
    for key in COMPARED:
        va, vb = getattr(a, key), getattr(b, key)
        if va != vb:
            va, vb = ({True: "on", False: "off"}.get(x, x) if isinstance(x, bool) else x for x in (va, vb))
            out.append(f"{FIELD_WORDS.get(key, key + ' ')}{va} (not {vb})")
    return ", ".join(out) or "the same degrees"


def _per_token(scored: Scored, key: str) -> float:
    return scored.result.time_breakdown_s.get(key, 0.0) / scored.training.tokens_per_step


def why_lost(loser: Scored, winner: Scored) -> str:
    """One clause: how much slower the runner-up is, the part of its step that grew most, and what differs.

    Parts are compared per token so a layout that rounded the global batch
    differently is judged on the same work. Equal speed means it lost the
    memory tie-break.
    """
    slower = loser.seconds_per_token / winner.seconds_per_token - 1.0
    diff = layout_diff(loser.layout, winner.layout)
    if slower < 1e-9:
        extra = (loser.result.memory.peak_bytes - winner.result.memory.peak_bytes) / GIB
        return f"as fast, but needs {sig(extra)} GiB more per GPU: {diff}"
    tokens = winner.training.tokens_per_step
    deltas = {k: (_per_token(loser, k) - _per_token(winner, k)) * tokens for k in STEP_PARTS}
    part = max(deltas, key=lambda k: deltas[k])
    return f"{percent(slower)} slower ({PART_WORDS[part]} +{seconds(deltas[part])} per step): {diff}"


def _micro_batches(n: int) -> str:
    return f"{n} micro-batch{'es' if n != 1 else ''}"


def _bubble_words(split: BubbleSplit, step_s: float, layout: Layout) -> str:
    """The pipeline's idle time as the simulator's two causes: stage imbalance and the schedule's bubble."""
    schedule = f"the {layout.pp_schedule} schedule's own warm-up and cool-down " \
               f"({_micro_batches(layout.grad_accum_steps)} over {layout.pp} stages)"
    if split.imbalance_s < 0.01 * step_s:
        return f"{percent(split.bubble_s / step_s)} idle in the pipeline, {schedule}"
    return (f"{percent(split.bubble_s / step_s)} idle in the pipeline: {percent(split.schedule_s / step_s)} "
            f"{schedule}, and {percent(split.imbalance_s / step_s)} stage imbalance, which more micro-batches do "
            f"not shrink: {chunk_words(split)} takes {seconds(split.heavy_s)} per micro-batch against "
            f"{seconds(split.mean_s)} on average")


def _memory_claim(best: Scored, ctx: Context) -> str:
    """What full memory rules out, each claim checked: the heavier choice's memory over the plan's limit."""
    lay, ruled = best.layout, []
    if lay.grad_accum_steps % 2 == 0:
        bigger = lay.replace(micro_batch_size=2 * lay.micro_batch_size, grad_accum_steps=lay.grad_accum_steps // 2)
        need = step_memory(ctx.model, best.training, bigger, ctx.cluster, ctx.calibration, ctx.engine).peak_bytes
        if need > ctx.capacity_bytes:
            ruled.append(f"micro-batch {bigger.micro_batch_size} ({sig(need / GIB)} GiB)")
    if lay.recompute != "none":
        lighter = lay.replace(**recompute_fields("none", 0, ()))
        need = step_memory(ctx.model, best.training, lighter, ctx.cluster, ctx.calibration, ctx.engine).peak_bytes
        if need > ctx.capacity_bytes:
            ruled.append(f"no recomputation ({sig(need / GIB)} GiB)")
    return f", which rules out {' and '.join(ruled)}" if ruled else ""


def _limit(best: Scored, cluster: Cluster, ctx: Context, split: BubbleSplit | None) -> str:
    """What limits the winner: its largest non-compute time, and memory when that is what stops it growing."""
    t = best.result.time_breakdown_s
    step = best.result.step_time_s
    part = max(STEP_PARTS[1:], key=lambda k: t.get(k, 0.0))
    share = t.get(part, 0.0) / step
    compute = f"compute is {percent(t.get('compute', 0.0) / step)} of the step"
    if share < 0.02:
        text = f"Limited by compute: {compute}, communication is hidden under it"
    elif part == "bubble" and split is not None:
        text = f"Besides compute ({compute}), the step spends {_bubble_words(split, step, best.layout)}"
    else:
        text = f"Besides compute ({compute}), the step spends {percent(share)} in {PART_WORDS[part]}"
    memory = best.result.memory.peak_bytes / cluster.gpu.memory_bytes
    if memory > 0.85:
        text += f"; memory is {percent(memory)} full{_memory_claim(best, ctx)}"
    return text + "."


LINK_WORDS = {"nvswitch": "NVLink", "xgmi": "Infinity Fabric", "pcie": "PCIe", "host": "shared memory"}


def _placement(layout: Layout, cluster: Cluster) -> str:
    """Where the per-layer collectives run: the first thing that decides a layout's speed."""
    if layout.tp == 1:
        return "No tensor parallelism: every GPU runs whole layers, so no per-layer collectives."
    sp = " with sequence parallelism" if layout.sequence_parallel else ""
    if layout.tp <= cluster.gpus_per_node:
        link = LINK_WORDS.get(cluster.intra_node, cluster.intra_node)
        return f"Tensor parallelism {layout.tp}{sp} stays inside one node, on {link}."
    nodes = -(-layout.tp // cluster.gpus_per_node)
    return (f"Tensor parallelism {layout.tp}{sp} spans {nodes} nodes: its per-layer collectives cross the "
            "inter-node network, and still beat the alternatives.")


def _mesh(layout: Layout) -> tuple[int, ...]:
    return layout.tp, layout.pp, layout.dp, layout.cp


def advice_context(result: SearchResult, cluster: Cluster, model: ModelSpec) -> Context:
    """The inputs the search simulated with, to simulate a suggested change the same way."""
    return Context(model, cluster, result.calibration, result.engine,
                   int(cluster.gpu.memory_bytes * result.usable_fraction))


def explanation(result: SearchResult, cluster: Cluster, model: ModelSpec) -> tuple[str, ...]:
    """Short sentences on why the winner wins and what limits it; every figure the simulator's."""
    best = result.best
    r = best.result
    s = result.stats
    ctx = advice_context(result, cluster, model)
    split = bubble_split(ctx, best.training, best.layout)
    out = [
        f"Best of {s.candidates} candidates ({s.simulated} simulated, the rest ruled out by memory or by a "
        f"lower bound on step time): {describe(best.layout)}.",
        f"Predicted {seconds(r.step_time_s)} per step{band_words(result.engine, cluster.gpu.name, model.moe is not None)}, "
        f"{thousands(r.tokens_per_s)} tokens/s, MFU {percent(r.mfu)}; "
        f"{sig(r.memory.peak_bytes / GIB)} of {cluster.gpu.memory_bytes / GIB:.0f} GiB per GPU.",
        _placement(best.layout, cluster),
        _limit(best, cluster, ctx, split),
    ]
    if len(result.ranked) > 1:
        out.append(f"Runner-up: {why_lost(result.ranked[1], best)}.")
    other = next((x for x in result.ranked[2:] if _mesh(x.layout) != _mesh(best.layout)), None)
    if other is not None and _mesh(result.ranked[1].layout) == _mesh(best.layout):
        out.append(f"Best other mesh in the top {len(result.ranked)}: {why_lost(other, best)}.")
    limit = batch_limit(best, ctx, split)
    if limit:
        out.append(limit)
    batch = best.training.global_batch_size
    if batch != result.target_batch:
        out.append(f"Global batch rounded from {result.target_batch} to {batch} sequences "
                   f"(a multiple of dp {best.layout.dp}).")
    return tuple(out)


# The schedule's own bubble (not stage imbalance) above this share of the step is worth a larger batch.
BUBBLE_WORTH_NAMING = 0.10


def batch_limit(best: Scored, ctx: Context, split: BubbleSplit | None) -> str | None:
    """A sentence when the global batch, not the hardware, limits the layout, with a change that helps.

    Two cases: the schedule's bubble (split from stage imbalance, planner.search.advice) is over
    BUBBLE_WORTH_NAMING of the step, or dp already gives each replica one sequence. The change
    proposed (twice the global batch, on this layout or with dp doubled out of pp or tp) is
    simulated as a layout of its own; the sentence appears only when it fits the memory limit
    and is faster per token, and gives its predicted tokens/s, gain and memory.
    """
    r, lay = best.result, best.layout
    batch = best.training.global_batch_size
    if split is not None and split.schedule_s / r.step_time_s > BUBBLE_WORTH_NAMING:
        found = best_suggestion(ctx, r, larger_batch_options(best.training, lay))
        if found is None:
            return None
        after = bubble_split(ctx, found.training, found.layout)
        return (f"The global batch limits this layout: {_micro_batches(lay.grad_accum_steps)} over {lay.pp} stages "
                f"leave the {lay.pp_schedule} schedule a {percent(split.schedule_s / r.step_time_s)} bubble; "
                f"{found.change} ({_micro_batches(found.layout.grad_accum_steps)}) is predicted at "
                f"{thousands(found.result.tokens_per_s)} tokens/s ({percent(found.gain)} more), a "
                f"{percent(after.schedule_s / found.result.step_time_s)} bubble and "
                f"{sig(found.result.memory.peak_bytes / GIB)} GiB per GPU, if training allows the larger batch.")
    if lay.dp == batch and (lay.pp > 1 or lay.tp > 1):
        found = best_suggestion(ctx, r, wider_dp_options(best.training, lay))
        if found is None:
            return None
        return (f"The global batch limits data parallelism: dp {lay.dp} already gives each replica one of the "
                f"{batch} sequences; {found.change} with {layout_diff(found.layout, lay)} is predicted at "
                f"{thousands(found.result.tokens_per_s)} tokens/s ({percent(found.gain)} more) and "
                f"{sig(found.result.memory.peak_bytes / GIB)} GiB per GPU, if training allows the larger batch.")
    return None


def infeasible_message(near: NearMiss | None, pins: Pins, n_gpus: int) -> str:
    """The smallest shortfall and what would fix it (only fixes the search could not try itself)."""
    if near is None:
        return f"no layout fits on {n_gpus} GPUs: add GPUs or use GPUs with more memory"
    fixes = ["add GPUs"]
    if pins.zero_stage is not None and pins.zero_stage < 3:
        fixes.append("ZeRO-3 (drop --zero)")
    if pins.recompute not in (None, "full") and near.what == "peak memory":
        fixes.append("full recomputation (drop --recompute)")
    for key in ("tp", "pp", "dp_shard", "micro_batch_size"):
        if getattr(pins, key) is not None:
            fixes.append(f"drop --{key.replace('_', '-')}")
    if near.what == "peak memory":
        fixes.append("a shorter --seq-len")
    if pins.offload in (None, "none"):
        fixes.append("model state in host memory (--offload auto)")
    fixes.append("GPUs with more memory")
    return (f"no layout fits: the closest ({describe(near.layout)}) needs {near.needed_bytes / GIB:.1f} GiB per GPU "
            f"({near.what}), has {near.capacity_bytes / GIB:.1f} ({near.usable_fraction:.0%} of the GPU's "
            f"memory): {', '.join(fixes)}")


def no_layout_error(result: SearchResult, pins: Pins, n_gpus: int, engine: str = "meshplan") -> MeshplanError:
    """Why the search came back empty: memory (InfeasibleError, exit 3) or the pins and batch (PlanError, exit 2)."""
    s = result.stats
    pinned = ", ".join(f"{k}={v}" for k, v in pins.pinned().items()) or "none"
    if pins.micro_batch_size is not None and pins.micro_batch_size > result.target_batch:
        return PlanError(f"--micro-batch {pins.micro_batch_size} is larger than the global batch "
                         f"({result.target_batch} sequences): lower --micro-batch or raise --global-batch")
    if result.near_miss is not None:
        host = f"; offloading layouts: {s.host_reason}" if s.host_reason else ""
        return InfeasibleError(infeasible_message(result.near_miss, pins, n_gpus) + host)
    if s.host_reason:
        return InfeasibleError(f"no layout fits on {n_gpus} GPUs: {s.host_reason}")
    if s.shapes == 0 and s.unsupported:
        if get_engine(engine).name != "meshplan":
            return PlanError(f"no layout of {n_gpus} GPUs with the pinned options ({pinned}) runs on engine "
                             f"{engine}: {s.unsupported_reason}")
        return PlanError(f"no layout of {n_gpus} GPUs with the pinned options ({pinned}) runs on meshplan's "
                         f"executor: {s.unsupported_reason}. To plan for another engine, pass --engine megatron, "
                         "torchtitan or deepspeed")
    if s.shapes == 0 and s.batch_rejected == 0:
        return PlanError(f"no layout of {n_gpus} GPUs satisfies the pinned options ({pinned}): unpin some of them")
    if s.shapes == 0:
        if result.batch_fixed:
            return PlanError(f"--global-batch {result.target_batch} is not a multiple of any data-parallel degree "
                             f"the pinned options ({pinned}) leave: pass a multiple of the dp you want")
        return PlanError(f"the default global batch ({result.target_batch} sequences, ~1M tokens) is more than 25% "
                         f"away from every multiple of the data-parallel degrees left (pinned: {pinned}): "
                         "pass --global-batch")
    return PlanError(f"no micro-batch count suits the pipeline schedules left (pinned: {pinned}, global batch "
                     f"{result.target_batch}): raise --global-batch, or unpin --pp-schedule/--micro-batch")


def alternative_json(scored: Scored, winner: Scored) -> dict[str, Any]:
    """plan.json's `alternatives` entry: parallel, prediction, why_lost (and its batch when it differs)."""
    entry: dict[str, Any] = {"parallel": scored.layout.to_json(), "prediction": scored.result.prediction().to_json(),
                             "why_lost": why_lost(scored, winner)}
    if scored.training.global_batch_size != winner.training.global_batch_size:
        entry["global_batch_size"] = scored.training.global_batch_size
    return entry


def build_plan(model: ModelSpec, cluster: Cluster, result: SearchResult, engine: str) -> Plan:
    """The plan.json document of the winner, with alternatives and explanation."""
    best = result.best
    eng = get_engine(engine)  # plan.json names the attention kernel: no engine default left to resolve
    training = best.training.replace(attention="fused" if eng.fused_attention(best.training) else "eager")
    prediction = best.result.prediction()
    prediction = dataclasses.replace(prediction, extra={
        **prediction.extra, "uncertainty": uncertainty_json(engine, cluster.gpu.name, model.moe is not None)})
    return Plan(model=model, cluster=cluster, training=training, layout=best.layout, engine=engine,
                prediction=prediction,
                alternatives=tuple(alternative_json(s, best) for s in result.ranked[1:]),
                explanation=explanation(result, cluster, model) + tuple(
                    s for s in [long_context_sentence(model, training.seq_len)] if s))
