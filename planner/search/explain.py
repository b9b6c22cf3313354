"""Explanations: why the winner wins, why each runner-up lost, why nothing fits.

Every sentence is computed from the simulated numbers (time breakdowns,
memory breakdowns, the layouts' differences), never canned: a reader should
be able to check each claim against the table.
"""

from __future__ import annotations

from typing import Any

from planner.engines import get_engine
from planner.layout import Layout, recompute_label
from planner.model.spec import ModelSpec
from planner.plan import Plan
from planner.search.candidates import Pins
from planner.search.search import NearMiss, Scored, SearchResult
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
    text += f" Z{layout.zero_stage} mb{layout.micro_batch_size}x{layout.grad_accum_steps}"
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
        return f"as fast, but needs {extra:.2f} GiB more per GPU: {diff}"
    tokens = winner.training.tokens_per_step
    deltas = {k: (_per_token(loser, k) - _per_token(winner, k)) * tokens for k in STEP_PARTS}
    part = max(deltas, key=lambda k: deltas[k])
    share = f"{slower:.1%}" if slower >= 1e-3 else f"{slower:.3%}"
    return f"{share} slower ({PART_WORDS[part]} +{deltas[part] * 1e3:.1f} ms per step): {diff}"


def _limit(best: Scored, cluster: Cluster) -> str:
    """What limits the winner: its largest non-compute time, and memory when that is what stops it growing."""
    t = best.result.time_breakdown_s
    step = best.result.step_time_s
    part = max(STEP_PARTS[1:], key=lambda k: t.get(k, 0.0))
    share = t.get(part, 0.0) / step
    compute = f"compute is {t.get('compute', 0.0) / step:.0%} of the step"
    if share < 0.02:
        text = f"Limited by compute: {compute}, communication is hidden under it"
    else:
        text = f"Besides compute ({compute}), the step spends {share:.0%} in {PART_WORDS[part]}"
    memory = best.result.memory.peak_bytes / cluster.gpu.memory_bytes
    if memory > 0.85:
        blocked = ["a larger micro-batch"] + (["less recomputation"] if best.layout.recompute != "none" else [])
        text += f"; memory is {memory:.0%} full, which rules out {' or '.join(blocked)}"
    return text + "."


LINK_WORDS = {"nvswitch": "NVLink", "pcie": "PCIe", "host": "shared memory"}


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


def explanation(result: SearchResult, cluster: Cluster) -> tuple[str, ...]:
    """Short sentences on why the winner wins and what limits it."""
    best = result.best
    r = best.result
    s = result.stats
    out = [
        f"Best of {s.candidates} candidates ({s.simulated} simulated, the rest ruled out by memory or by a "
        f"lower bound on step time): {describe(best.layout)}.",
        f"Predicted {r.step_time_s:.3f} s per step, {r.tokens_per_s:,.0f} tokens/s, MFU {r.mfu:.1%}; "
        f"{r.memory.peak_bytes / GIB:.1f} of {cluster.gpu.memory_bytes / GIB:.0f} GiB per GPU.",
        _placement(best.layout, cluster),
        _limit(best, cluster),
    ]
    if len(result.ranked) > 1:
        out.append(f"Runner-up: {why_lost(result.ranked[1], best)}.")
    other = next((x for x in result.ranked[2:] if _mesh(x.layout) != _mesh(best.layout)), None)
    if other is not None and _mesh(result.ranked[1].layout) == _mesh(best.layout):
        out.append(f"Best other mesh in the top {len(result.ranked)}: {why_lost(other, best)}.")
    limit = batch_limit(best)
    if limit:
        out.append(limit)
    batch = best.training.global_batch_size
    if batch != result.target_batch:
        out.append(f"Global batch rounded from {result.target_batch} to {batch} sequences "
                   f"(a multiple of dp {best.layout.dp}).")
    return tuple(out)


# A pipeline bubble above this share of the step is worth a sentence on the batch.
BUBBLE_WORTH_NAMING = 0.10


def batch_limit(best: Scored) -> str | None:
    """A sentence when the global batch, not the hardware, limits the layout: a large bubble or dp at its cap.

    The bubble of a 1F1B-like schedule with m micro-batches over p stages is
    about (p - 1) / (m + p - 1) of the step, so the simulated bubble is scaled
    by that ratio to say what a larger batch would leave.
    """
    r, lay = best.result, best.layout
    batch = best.training.global_batch_size
    bubble = r.time_breakdown_s.get("bubble", 0.0) / r.step_time_s if r.step_time_s > 0 else 0.0
    if lay.pp > 1 and bubble > BUBBLE_WORTH_NAMING:
        m, p = lay.grad_accum_steps, lay.pp
        want = max(4 * p, 2 * m)
        after = bubble * (m + p - 1) / (want + p - 1)
        return (f"The global batch limits this layout: {m} micro-batches over {p} pipeline stages leave a "
                f"{bubble:.0%} pipeline bubble; --global-batch {lay.dp * lay.micro_batch_size * want} ({want} "
                f"micro-batches) would cut it to about {after:.0%}.")
    if lay.dp == batch and (lay.pp > 1 or lay.tp > 1):
        return (f"The global batch limits data parallelism: dp {lay.dp} already gives each replica one of the "
                f"{batch} sequences, so the rest of the GPUs go to tp/pp; --global-batch {2 * batch} would let "
                "dp grow.")
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
        return InfeasibleError(infeasible_message(result.near_miss, pins, n_gpus))
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
    return Plan(model=model, cluster=cluster, training=training, layout=best.layout, engine=engine,
                prediction=best.result.prediction(),
                alternatives=tuple(alternative_json(s, best) for s in result.ranked[1:]),
                explanation=explanation(result, cluster))
