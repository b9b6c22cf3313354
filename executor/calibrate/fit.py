"""Fitting: measured microbenchmarks -> the planner's CalibrationProfile.

Every parameter is fitted by asking the simulator's OWN time model
(`planner.simulate.compute`, `topologies.collectives`) to reproduce the measurements,
so a fitted profile predicts the benchmarks it came from by construction and
no formula is duplicated here. Residuals are relative (log of predicted over
measured time), so a 100 us GEMM weighs as much as a 100 ms one.

  gemm_efficiency, gemm_knee   least squares over the GEMM grid of the training
                               dtype: t = 2mnk / (peak * eff) * (1 + knee (1/m + 1/n + 1/k))
  attention_efficiency         geometric mean of t_model(eff=1) / t_measured over
                               the causal SDPA forward+backward samples
  memory_efficiency            the same over device copies (bytes = read + write)
  optimizer_bytes_per_param    t_adamw * HBM bandwidth * memory_efficiency / params
  layer_overhead_s             forward time of a tiny block (host-bound: the GPU work is nil)
  link_efficiency,             the topology model's collective times reproduce the
  latency_scale                measured ones (log least squares, see fit_comm); only
                               the link classes of this one node are measured
  collective_scale             per operation, what the fitted model still misses
                               (fit_collective_scale), at the plan's message sizes
  other_bytes                  device memory in use beyond PyTorch's allocator on a
                               rank that ran NCCL collectives (CUDA context, NCCL
                               buffers); CUDA only, None on CPU
  with --model (fit_blocks, from one executor block timed plain, under TP and FSDP):
  compute level                one factor on the three efficiencies so the plain
                               block's kernels + host time match its measurement
  dtensor_op_overhead_s        the TP block's surplus per operator dispatched on DTensors
  fsdp_call_overhead_s         the FSDP block's surplus per FSDP all-gather / reduce-scatter
  solo_speedup                 the plain block on all ranks at once over on one rank alone

`update_profile_from_run` folds a real training run into a profile (the rule
is in its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from executor.calibrate.bench import AttentionSample, GemmSample, MemorySample
from executor.calibrate.comm import CommSample
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import attention_core_times, gemm_time_s, memory_time_s
from planner.training import DTYPE_BYTES
from topologies.cluster import Cluster
from topologies.errors import ExecutionError
from topologies.hardware import GPUSpec

EFF_BOUNDS = (1e-4, 1.5)  # what CalibrationProfile accepts for a fraction (a floor keeps logs finite)


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def fit_gemm(samples: Sequence[GemmSample], peak_flops: float, base: CalibrationProfile) -> tuple[float, float]:
    """(gemm_efficiency, gemm_knee) minimizing sum(log(t_model / t_measured)^2)."""
    import numpy as np
    from scipy.optimize import least_squares

    if not samples:
        raise ExecutionError("no GEMM samples to fit: the benchmark grid was empty")

    def residuals(x: np.ndarray) -> np.ndarray:
        cal = base.replace(gemm_efficiency=float(x[0]), gemm_knee=float(x[1]))
        return np.array([math.log(gemm_time_s(s.m, s.n, s.k, peak_flops, cal) / s.time_s) for s in samples])

    start = [_clamp(base.gemm_efficiency, *EFF_BOUNDS), max(base.gemm_knee, 1.0)]
    fit = least_squares(residuals, start, bounds=([EFF_BOUNDS[0], 0.0], [EFF_BOUNDS[1], 1e5]))
    return float(fit.x[0]), float(fit.x[1])


def fit_attention(samples: Sequence[AttentionSample], gpu: GPUSpec, peak_flops: float,
                  base: CalibrationProfile) -> float:
    """attention_efficiency: the model's time at efficiency 1 over the measured time, geometric mean."""
    unit = base.replace(attention_efficiency=1.0)
    ratios = []
    for s in samples:
        fwd, bwd = attention_core_times(s.batch * s.heads, s.seq_len, s.seq_len, s.head_dim, DTYPE_BYTES[s.dtype], 0.0, True,
                                        gpu, peak_flops, unit)
        ratios.append((fwd + bwd) / s.time_s)
    return _clamp(_geomean(ratios), *EFF_BOUNDS)


def fit_memory(samples: Sequence[MemorySample], gpu: GPUSpec, base: CalibrationProfile) -> float:
    """memory_efficiency: copy time at efficiency 1 over the measured time, geometric mean."""
    unit = base.replace(memory_efficiency=1.0)
    return _clamp(_geomean([memory_time_s(2 * s.size_bytes, gpu, unit) / s.time_s for s in samples]), *EFF_BOUNDS)


def optimizer_bytes_per_param(time_s: float, n_params: int, gpu: GPUSpec, memory_efficiency: float) -> float:
    """Bytes per parameter an AdamW step streams, given its measured time (inverse of optimizer_time_s)."""
    return time_s * gpu.memory_gbytes_per_s * 1e9 * memory_efficiency / n_params


def local_link_classes(cluster: Cluster) -> tuple[str, ...]:
    """Efficiency classes of the links inside this node (NVLink SHARP too when the switch has it)."""
    from topologies.links import derive_labels, link_class

    classes = {link_class(lab) for row in derive_labels(cluster) for lab in row if lab != "X"}
    if cluster.intra_node == "nvswitch" and cluster.gpu.nvlink_gen >= 4:
        classes.add("nvls")
    return tuple(sorted(classes))


def fit_comm(samples: Sequence[CommSample], cluster: Cluster) -> tuple[dict[str, float], float] | None:
    """(link_efficiency of this node's classes, latency_scale), or None without samples.

    One factor f scales the default efficiency of every class the node uses
    (eff_c = f * EFFICIENCY[c], at most 1) and latency_scale scales every hop
    and launch latency; both minimize sum(log(t_model / t_measured)^2) with
    t_model = CollectiveModel(cluster, eff, latency_scale).time_s - the
    simulator's own collective model. collective_overhead_s (framework
    dispatch) is not separable from latency in bare collectives: `fit_blocks`
    measures it inside real TP and FSDP blocks.
    """
    import numpy as np
    from scipy.optimize import least_squares

    from topologies.collectives import CollectiveModel
    from topologies.links import EFFICIENCY

    if not samples:
        return None
    classes = local_link_classes(cluster)

    def efficiencies(f: float) -> dict[str, float]:
        return {c: min(1.0, f * EFFICIENCY[c]) for c in classes}

    def residuals(x: np.ndarray) -> np.ndarray:
        model = CollectiveModel(cluster, efficiency=efficiencies(float(x[0])), latency_scale=float(x[1]))
        return np.array([math.log(model.time_s(s.op, s.size_bytes, tuple(range(s.n_ranks))) / s.time_s)
                         for s in samples])

    top = 1.0 / min(EFFICIENCY[c] for c in classes)
    fit = least_squares(residuals, [min(1.0, top), 1.0], bounds=([1e-3, 1e-3], [top, 1e4]))
    return efficiencies(float(fit.x[0])), float(fit.x[1])


def fit_collective_scale(samples: Sequence[CommSample], cluster: Cluster, efficiency: dict[str, float],
                         latency_scale: float, sizes: Sequence[int] | None = None) -> dict[str, float]:
    """collective_scale: per operation, the geometric mean of measured over modelled time.

    The alpha-beta model with one link efficiency and one latency scale is the
    same for every operation; a backend's own algorithm is not (gloo's
    reduce-scatter costs about a full all-reduce). Only samples at `sizes`
    (the plan's messages, within 1%) count when given, so the factor is right
    where the plan reads it.
    """
    from topologies.collectives import CollectiveModel

    model = CollectiveModel(cluster, efficiency=efficiency, latency_scale=latency_scale)
    ratios: dict[str, list[float]] = {}
    for s in samples:
        if sizes and min(abs(math.log(s.size_bytes / max(z, 1))) for z in sizes) > 0.01:
            continue
        ratios.setdefault(s.op, []).append(s.time_s / model.time_s(s.op, s.size_bytes, tuple(range(s.n_ranks))))
    return {op: _clamp(_geomean(r), 1e-3, 1e3) for op, r in sorted(ratios.items())}


def fit_profile(*, gpu: GPUSpec, dtype: str, base: CalibrationProfile, gemm: Sequence[GemmSample],
                attention: Sequence[AttentionSample], memory: Sequence[MemorySample],
                adamw: tuple[float, int] | None, layer_overhead_s: float | None, comm: Sequence[CommSample],
                cluster: Cluster, other_bytes: int | None, source: str, date: str,
                scale_sizes: Sequence[int] | None = None) -> CalibrationProfile:
    """Every fit above, combined into one profile (fields without measurements keep `base`)."""
    peak = gpu.peak_flops(dtype)
    eff, knee = fit_gemm([s for s in gemm if s.dtype == dtype], peak, base)
    changes: dict[str, Any] = dict(gpu=gpu.name, gemm_efficiency=eff, gemm_knee=knee, source=source, date=date)
    if attention:
        # The benchmark times SDPA, the meshplan engine's own kernel; the profile stores the
        # base rate that `for_engine("meshplan")` scales down again, so divide the factor out.
        meshplan_factor = base.engine_factors.get("meshplan", {}).get("attention_efficiency", 1.0)
        changes["attention_efficiency"] = min(1.5, fit_attention(attention, gpu, peak, base) / meshplan_factor)
    if memory:
        changes["memory_efficiency"] = fit_memory(memory, gpu, base)
    if adamw:
        mem_eff = changes.get("memory_efficiency", base.memory_efficiency)
        changes["optimizer_bytes_per_param"] = optimizer_bytes_per_param(adamw[0], adamw[1], gpu, mem_eff)
    if layer_overhead_s is not None:
        changes["layer_overhead_s"] = layer_overhead_s
    fitted_comm = fit_comm(comm, cluster)
    if fitted_comm:
        changes["link_efficiency"] = {**base.link_efficiency, **fitted_comm[0]}
        changes["latency_scale"] = fitted_comm[1]
        changes["collective_scale"] = fit_collective_scale(comm, cluster, changes["link_efficiency"],
                                                           fitted_comm[1], scale_sizes)
    if other_bytes is not None:
        changes["other_bytes"] = other_bytes
    return base.replace(**changes)


def prediction_errors(profile: CalibrationProfile, gpu: GPUSpec, dtype: str,
                      gemm: Sequence[GemmSample]) -> list[float]:
    """Relative error of the fitted GEMM model on each sample of the training dtype (for the summary)."""
    peak = gpu.peak_flops(dtype)
    return [gemm_time_s(s.m, s.n, s.k, peak, profile) / s.time_s - 1.0 for s in gemm if s.dtype == dtype]


def fold_run(plan, profile: CalibrationProfile, measured_step_s: float,  # noqa: ANN001
             measured_peak_bytes: int | None) -> tuple[CalibrationProfile, dict[str, Any]]:
    """Fold one measured training step into a profile. The rule:

    1. time: per-part corrections (compute, host overhead, optimizer, each
       collective the layout issues), weighted by how much each part weighs
       in this run's simulated step and how uncertain calibrate's measurement
       of it is, scaled until the simulator reproduces the measured step
       (`executor.calibrate.fold`). A part the run does not exercise keeps its
       value, so what is learnt carries over to layouts that use it.
       `compute_factor` is the compute part's speed factor (< 1: slower).
    2. memory: other_bytes = measured peak - the memory model's tensor bytes
       (its peak without `other`), at least 0: what the run's allocator peak
       holds beyond the modelled tensors (the executor records
       torch.cuda.max_memory_allocated, so this is the allocator-visible
       remainder, not the CUDA context). Unchanged when the run recorded no
       peak, and for CPU runs, whose peak is the process's resident set.
    """
    from executor.calibrate.fold import fold_step
    from planner.memory.estimate import estimate_memory
    from planner.simulate.step import simulate_step

    def step_s(p: CalibrationProfile) -> float:
        return simulate_step(plan.model, plan.training, plan.layout, plan.cluster, p, engine=plan.engine).step_time_s

    new, info = fold_step(step_s, profile, measured_step_s)
    info["compute_factor"] = 1.0 / info["levers"].get("compute", 1.0)
    if measured_peak_bytes and plan.cluster.gpu.kind != "cpu":
        est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
        # the run reports torch.cuda.max_memory_allocated: the part of it the tensor model misses becomes
        # `other`, and the allocator's modelled reserve stays on top of it in later predictions
        new = new.replace(other_bytes=max(0, int(measured_peak_bytes) - est.allocated_bytes))
        info["other_bytes"] = new.other_bytes
    return new, info


def update_profile_from_run(plan_path: Path, measured: dict[str, Any], profile_path: Path) -> dict[str, Any]:
    """`report --update-calibration`: load (or start from the GPU's defaults), fold, save."""
    import datetime

    from planner.plan import load_plan
    from planner.simulate.calibration import load_calibration

    plan = load_plan(plan_path)
    profile = load_calibration(profile_path if profile_path.exists() else None, plan.cluster.gpu)
    new, info = fold_run(plan, profile, measured["step_time_s"], measured.get("peak_memory_bytes"))
    run = plan_path.parent.name
    source = profile.source if run in profile.source else f"{profile.source}; folded run {run}"
    new.replace(gpu=plan.cluster.gpu.name, source=source, date=datetime.date.today().isoformat()).save(profile_path)
    return {**info, "profile": str(profile_path)}


def fit_blocks(profile: CalibrationProfile, gpu: GPUSpec, dtype: str, model: Any, cluster: Cluster,
               blocks: dict[str, Any]) -> dict[str, Any]:
    """Profile changes from one executor block timed plain, alone, under TP and under FSDP (`blocks`).

    The simulator prices a layer's pass as combine(kernels + exposed comm,
    host, p), host from `planner.simulate.host.layer_host_s`: layer_overhead_s
    per pass (1 forward, 2 backward), collective_overhead_s per collective,
    DTensor operators under TP, FSDP calls under ZeRO-3. Each block isolates
    one of its terms:

    1. compute level: the plain block at the plan's shapes, with the ranks
       sharing the cores, is the most faithful measurement of a layer; the
       kernel fits set the shape dependence, and one factor on gemm_,
       attention_ and memory_efficiency makes kernels + host (the tiny-block
       layer_overhead_s) reproduce it (clamped to 5x either way).
    2. dtensor_ops_forward / _backward: the operators counted on DTensors per
       TP-split linear (`tp_ops`); dtensor_op_overhead_s: what the TP block
       takes beyond its kernels at the TP shard's shapes, its all-reduces and
       the eager host time, per DTensor operator (at least 0).
    3. fsdp_call_overhead_s: what the FSDP block takes beyond its kernels,
       gathers, reduce-scatter and eager host time, per FSDP collective.
    4. solo_speedup: the plain block on all ranks at once over the same block
       on one rank while the others wait (1 to 4).
    """
    from planner.layout import Layout
    from planner.memory.params import layer_params_split
    from planner.simulate.comm import StepComm
    from planner.simulate.compute import fsdp_copy_times, layer_times
    from planner.simulate.host import fsdp_calls, layer_host_s, tp_linears_per_layer

    peak, d = gpu.peak_flops(dtype), DTYPE_BYTES[dtype]
    mb, seq, world = int(blocks["micro_batch"]), int(blocks["seq_len"]), int(blocks["world"])
    p, layer = profile.overlap_exponent, profile.layer_overhead_s

    def kernels_s(cal: CalibrationProfile, layout: Layout) -> float:
        cal = cal.for_engine("meshplan")  # the executor's kernels
        lt = layer_times(model, seq, d, layout, gpu, peak, cal) + fsdp_copy_times(model, d, 4, layout, gpu, cal)
        return lt.forward_s + lt.backward_s

    def busy_s(measured: float, host: float) -> float:  # inverse of combine in its first argument
        return max(measured**p - host**p, 1e-9) ** (1.0 / p)

    def host_s(measured: float, busy: float) -> float:  # inverse of combine in its second argument
        return max(measured**p - busy**p, 0.0) ** (1.0 / p)

    def eager_host_s(cal: CalibrationProfile, layout: Layout, calls: tuple[int, int]) -> float:
        """The block's host time without the term being fitted (that term is 0 in `cal`)."""
        return sum(layer_host_s(model, layout, cal, layer, calls))

    plain = Layout(micro_batch_size=mb)
    factor = _clamp(kernels_s(profile, plain) / busy_s(float(blocks["plain"]), 3.0 * layer), 0.2, 5.0)
    changes: dict[str, Any] = {k: _clamp(getattr(profile, k) * factor, EFF_BOUNDS[0], EFF_BOUNDS[1])
                               for k in ("gemm_efficiency", "attention_efficiency", "memory_efficiency")}
    if blocks.get("plain_solo"):
        changes["solo_speedup"] = _clamp(float(blocks["plain"]) / float(blocks["plain_solo"]), 1.0, 4.0)
    cal = profile.replace(**changes)
    if blocks.get("tp_ops"):
        changes["dtensor_ops_forward"], changes["dtensor_ops_backward"] = (float(x) for x in blocks["tp_ops"])
        cal = cal.replace(dtensor_ops_forward=changes["dtensor_ops_forward"],
                          dtensor_ops_backward=changes["dtensor_ops_backward"])
    if blocks.get("tp"):
        tp = Layout(tp=world, micro_batch_size=mb)
        comm = 4 * StepComm(cluster, tp, cal).tp_point_s(mb * seq * model.hidden * d, False)
        surplus = host_s(float(blocks["tp"]), kernels_s(cal, tp) + comm) - \
            eager_host_s(cal.replace(dtensor_op_overhead_s=0.0), tp, (2, 2))
        ops = tp_linears_per_layer(model) * (cal.dtensor_ops_forward + cal.dtensor_ops_backward)
        changes["dtensor_op_overhead_s"] = max(0.0, surplus / ops) if ops else 0.0
    if blocks.get("fsdp"):
        z3 = Layout(dp_shard=world, zero_stage=3, micro_batch_size=mb)
        step = StepComm(cluster, z3, cal)
        params = sum(layer_params_split(model, 1, 1))
        comm = 2 * step.time_s("all_gather", params * d, ("dp_shard",)) + \
            step.time_s("reduce_scatter", params * 4, ("dp_shard",))
        calls = fsdp_calls(z3)
        surplus = host_s(float(blocks["fsdp"]), kernels_s(cal, z3) + comm) - \
            eager_host_s(cal.replace(fsdp_call_overhead_s=0.0), z3, calls)
        changes["fsdp_call_overhead_s"] = max(0.0, surplus / sum(calls))
    return changes
