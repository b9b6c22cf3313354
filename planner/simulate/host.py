"""Host work of one layer pass, and the speed of a rank whose core-sharing peers idle.

Two costs the kernel roofline does not see, each a physical figure that
`meshplan calibrate` measures (`executor.calibrate.blocks`) and
`report --update-calibration` corrects on its own lever
(`executor.calibrate.fold`):

* host time per layer pass (`layer_host_s`): the eager kernels' Python and
  dispatch (`layer_overhead_s`, once per forward, twice per backward), and on
  top of it what the parallel wrappers dispatch. Under TP each TP-split linear
  runs `dtensor_ops_forward` (backward: `dtensor_ops_backward`) operators on
  DTensors, each paying `dtensor_op_overhead_s` for sharding propagation and
  redistribution planning; the attention and MLP bodies between the linears
  run on local tensors (`use_local_output`), so the count is per linear, not
  per operator of the block. `layer_overhead_s` is the host time of a
  reference dense layer; a layer that dispatches more or fewer operations
  (MLA, routers, token dispatch, per-expert GEMMs, CUDA graph replays) scales
  it by `layer_host_scale` (`planner.simulate.launches`). Under FSDP each all-gather and reduce-scatter
  pays `fsdp_call_overhead_s` for FSDP2's copy-in, copy-out and hooks. A
  layout without TP or FSDP pays neither.
* shared cores (`solo_repriced`): CPU ranks share cores, caches and
  memory bandwidth, so a rank computing while the others wait runs its
  kernels `solo_speedup` times faster than while all compute. A pipeline's
  warm-up, cool-down and bubbles are such moments; pricing every operation
  at the all-busy rate overestimates pipeline steps on CPU ranks. GPUs own
  their device (speedup 1): nothing changes there.
"""

from __future__ import annotations

from planner.layout import Layout, recomputed_fraction
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.launches import host_scale
from planner.training import TrainingSpec


def tp_linears_per_layer(model: ModelSpec) -> int:
    """Linears of one layer that TP splits (executor.parallel.parallelize.block_tp_plan): q, k, v and o,
    and the dense MLP's 3 (SwiGLU) or 2 matrices; a MoE MLP stays replicated over TP (experts go to EP)."""
    return 4 + (0 if model.moe is not None else (3 if model.mlp == "swiglu" else 2))


def dtensor_ops(model: ModelSpec, layout: Layout, cal: CalibrationProfile) -> tuple[float, float]:
    """DTensor operators one layer dispatches per forward and per backward pass (recomputation included)."""
    if layout.tp == 1:
        return 0.0, 0.0
    linears = tp_linears_per_layer(model)
    forward = linears * cal.dtensor_ops_forward
    return forward, linears * cal.dtensor_ops_backward + recomputed_fraction(layout, model.n_layers) * forward


def fsdp_calls(layout: Layout) -> tuple[int, int]:
    """FSDP collectives of one layer per forward and backward pass (ZeRO-3 gathers in both, ZeRO-2/3
    reduce-scatter in the backward)."""
    if layout.zero_stage < 2 or layout.shard_ranks == 1:
        return 0, 0
    gathers = int(layout.zero_stage == 3)
    return gathers, gathers + 1


def layer_host_scale(model: ModelSpec, training: TrainingSpec, layout: Layout, fused_attention: bool
                     ) -> tuple[float, float]:
    """The layer's eager host time of one (forward, backward) over layer_overhead_s (the reference
    dense layer's forward; its backward is 2): its operations as `planner.simulate.launches` counts
    them under the training's recipe options."""
    return host_scale(model, layout, fused_attention, training.cuda_graphs, training.moe_grouped_gemm,
                      training.moe_router_fusion, training.moe_router_graphs)


def layer_host_s(model: ModelSpec, layout: Layout, cal: CalibrationProfile, layer_s: float,
                 calls: tuple[int, int], backward_s: float | None = None) -> tuple[float, float]:
    """(forward, backward) host seconds of one layer pass.

    layer_s: the eager kernels' host time of one forward (layer_overhead_s,
    scaled for compiled steps and by `layer_host_scale`); backward_s: theirs of
    one backward (None: twice layer_s); calls: the collectives the pass
    issues, each paying collective_overhead_s. Recomputation redoes the forward.
    """
    eager_b = (2.0 * layer_s if backward_s is None else backward_s) \
        + recomputed_fraction(layout, model.n_layers) * layer_s
    ops_f, ops_b = dtensor_ops(model, layout, cal)
    fsdp_f, fsdp_b = fsdp_calls(layout)
    forward = layer_s + calls[0] * cal.collective_overhead_s + ops_f * cal.dtensor_op_overhead_s \
        + fsdp_f * cal.fsdp_call_overhead_s
    backward = eager_b + calls[1] * cal.collective_overhead_s + ops_b * cal.dtensor_op_overhead_s \
        + fsdp_b * cal.fsdp_call_overhead_s
    return forward, backward


def end_host_s(layout: Layout, cal: CalibrationProfile) -> tuple[float, float]:
    """(forward, backward) DTensor host seconds of one model end (embedding or output layer) under TP:
    one split linear's operators (the embedding is split by rows, the output by columns)."""
    if layout.tp == 1:
        return 0.0, 0.0
    return cal.dtensor_ops_forward * cal.dtensor_op_overhead_s, cal.dtensor_ops_backward * cal.dtensor_op_overhead_s


def alone_factors(ops, n_ranks: int, speedup: float, ranks_per_stage: int = 1) -> list[float]:  # noqa: ANN001
    """Per pipeline rank, the mean time factor of its operations given who computes beside them.

    ops: the pipeline's operations (rank, start_s, end_s). An instant where k
    of the other n - 1 pipeline ranks are idle runs at 1 - (1 - 1/speedup) * k / (n - 1)
    of the all-busy time (every rank of an idle stage idles: with
    ranks_per_stage > 1 the idle share counts the world, not the stages).
    """
    if speedup <= 1.0 or n_ranks < 2:
        return [1.0] * n_ranks
    world = n_ranks * ranks_per_stage
    edges = sorted({t for op in ops for t in (op.start_s, op.end_s)})
    busy_time = [0.0] * n_ranks
    weighted = [0.0] * n_ranks
    by_rank: list[list[tuple[float, float]]] = [[] for _ in range(n_ranks)]
    for op in ops:
        by_rank[op.rank].append((op.start_s, op.end_s))
    for intervals in by_rank:
        intervals.sort()
    cursor = [0] * n_ranks
    for a, b in zip(edges, edges[1:], strict=False):
        if b <= a:
            continue
        busy = []
        for r in range(n_ranks):
            iv = by_rank[r]
            while cursor[r] < len(iv) and iv[cursor[r]][1] <= a:
                cursor[r] += 1
            busy.append(cursor[r] < len(iv) and iv[cursor[r]][0] <= a)
        idle_ranks = (n_ranks - sum(busy)) * ranks_per_stage
        factor = 1.0 - (1.0 - 1.0 / speedup) * idle_ranks / (world - 1)
        for r in range(n_ranks):
            if busy[r]:
                busy_time[r] += b - a
                weighted[r] += (b - a) * factor
    return [weighted[r] / busy_time[r] if busy_time[r] > 0 else 1.0 for r in range(n_ranks)]


def solo_repriced(layout: Layout, speedup: float, n_micro: int, p2p_s: list[float], durations: list[list[float]],
                  compute: list[float], comm_kinds: dict[str, list[float]]
                  ) -> tuple[list[list[float]], list[float], dict[str, list[float]]]:
    """durations[kind][chunk], per-chunk compute and comm with each chunk scaled by its rank's
    `alone_factors` in the schedule run at the all-busy rate (one correction, not a fixed point:
    the re-run schedule overlaps a little differently)."""
    from planner.simulate.pipeline import chunk_owner, simulate_pipeline

    schedule, pp, v = layout.pp_schedule, layout.pp, layout.virtual_stages
    ops = simulate_pipeline(schedule, pp, v, n_micro, durations, p2p_s, True).ops
    factors = alone_factors(ops, pp, speedup, layout.world_size // pp)
    owner = chunk_owner(schedule, pp, v)
    scale = [factors[owner[c]] for c in range(len(owner))]
    return ([[d * scale[c] for c, d in enumerate(kind)] for kind in durations],
            [x * scale[c] for c, x in enumerate(compute)],
            {k: [x * scale[c] for c, x in enumerate(xs)] for k, xs in comm_kinds.items()})
