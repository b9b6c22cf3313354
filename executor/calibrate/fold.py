"""Folding one measured step into a profile as per-part corrections that carry over to other layouts.

One run gives one number (its step time) and a profile has many parts that
could be wrong. The parts ("levers"), each a multiplicative correction s:

  compute     time of local work: gemm_, attention_ and memory_efficiency / s
  host        layer_overhead_s and collective_overhead_s * s (Python, kernel
              launches: what a tiny-block benchmark measures worst)
  dtensor     dtensor_op_overhead_s * s (the host time of each operator on a
              DTensor: only layouts with TP exercise it)
  fsdp        fsdp_call_overhead_s * s (FSDP2's copies and hooks around each
              all-gather and reduce-scatter: only ZeRO-2/3 layouts)
  optimizer   optimizer_bytes_per_param * s
  <op>        collective_scale[op] * s for each collective the layout issues
              (all_reduce, all_gather, reduce_scatter, send_recv, ...)

The rule picks the most plausible corrections that reproduce the measurement:
minimise sum((log s_i / sigma_i)^2) subject to simulate(s) = measured, where
sigma_i is how far `meshplan calibrate`'s own measurement of that part can be
from what a run sees (PRIOR_SIGMA). To first order the optimum is
log s_i = lam * sigma_i^2 * e_i, e_i the elasticity d log(step) / d log(s_i)
of the simulated step (finite differences); lam follows by bisection on the
real simulator, so the folded profile reproduces the run exactly (unless
every lever hits its bound: `reached` False). A part the run barely
exercises (e_i ~ 0) keeps its value: a DDP run teaches compute, not the
all-gathers of ZeRO-3 nor DTensor's host time, and a TP run splits its error
between compute, DTensor's operators and its all-reduces by how much each
weighs in its step and how uncertain each is. Since the TP-only mechanisms
have their own levers (and calibrate's measurement of them is the least
certain), a TP run's surplus lands there rather than in a compute factor
that DDP would then inherit.
"""

from __future__ import annotations

import math
from typing import Any

from planner.simulate.calibration import CalibrationProfile

# How far calibrate's measurement of each part may be from a run (log-space standard deviation):
# compute is measured on the executor's own block at the plan's shapes with the ranks sharing
# the cores, minutes before the run (what remains is the machine's drift); the eager host time on a
# tiny block; collectives alone, not between the run's kernels; DTensor's and FSDP's host costs as
# the surplus of a block over everything else, the least certain figures, which also carry the
# waits of ranks that meet at every collective.
PRIOR_SIGMA = {"compute": 0.15, "host": 0.5, "dtensor": 1.0, "fsdp": 1.0, "optimizer": 0.3, "collective": 0.6}
COMPUTE_FIELDS = ("gemm_efficiency", "attention_efficiency", "memory_efficiency")
EFF_MAX = 1.5
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
LEVERS = ("compute", "host", "dtensor", "fsdp", "optimizer", *COLLECTIVES)
# the profile fields each lever scales (compute divides the efficiencies; collectives scale collective_scale[op])
LEVER_FIELDS = {"compute": COMPUTE_FIELDS, "host": ("layer_overhead_s", "collective_overhead_s"),
                "dtensor": ("dtensor_op_overhead_s",), "fsdp": ("fsdp_call_overhead_s",),
                "optimizer": ("optimizer_bytes_per_param",)}
STEP = 0.05  # relative change of a lever for the elasticity (finite difference)


def apply_levers(profile: CalibrationProfile, scales: dict[str, float]) -> CalibrationProfile:
    """The profile with each lever's time multiplied by scales[lever] (see the module docstring)."""
    changes: dict[str, Any] = {}
    c = scales.get("compute", 1.0)
    if c != 1.0:
        changes.update({k: min(EFF_MAX, getattr(profile, k) / c) for k in COMPUTE_FIELDS})
    for lever in ("host", "dtensor", "fsdp", "optimizer"):
        if scales.get(lever, 1.0) != 1.0:
            changes.update({k: getattr(profile, k) * scales[lever] for k in LEVER_FIELDS[lever]})
    ops = {op: s for op, s in scales.items() if op in COLLECTIVES and s != 1.0}
    if ops:
        current = dict(profile.collective_scale)
        changes["collective_scale"] = {**current, **{op: min(1e3, max(1e-3, current.get(op, 1.0) * s))
                                                     for op, s in ops.items()}}
    return profile.replace(**changes) if changes else profile


def _sigma(lever: str) -> float:
    return PRIOR_SIGMA["collective"] if lever in COLLECTIVES else PRIOR_SIGMA[lever]


def elasticities(step_s, profile: CalibrationProfile) -> dict[str, float]:  # noqa: ANN001
    """d log(step) / d log(s) of every lever, by a forward difference of STEP."""
    base = step_s(profile)
    out = {}
    for lever in LEVERS:
        moved = step_s(apply_levers(profile, {lever: 1.0 + STEP}))
        out[lever] = max(0.0, math.log(moved / base) / math.log1p(STEP))
    return out


def fold_step(step_s, profile: CalibrationProfile, measured_s: float  # noqa: ANN001
              ) -> tuple[CalibrationProfile, dict[str, Any]]:
    """The prior-weighted corrections that make step_s(profile) equal measured_s.

    step_s: a function profile -> simulated step time of the run's plan.
    Returns the new profile and what changed: each lever's factor, the
    elasticities, the simulated step before and after.
    """
    before = step_s(profile)
    e = elasticities(step_s, profile)
    weights = {lever: _sigma(lever) ** 2 * e[lever] for lever in LEVERS}
    if not any(weights.values()):
        return profile, {"levers": {}, "elasticities": e, "reached": False, "step_time_s_before": before,
                         "step_time_s_after": before, "measured_step_time_s": measured_s}

    def scales(lam: float) -> dict[str, float]:
        return {lever: math.exp(lam * w) for lever, w in weights.items() if w > 0}

    def simulated(lam: float) -> float:
        return step_s(apply_levers(profile, scales(lam)))

    # lam: log s_i = lam * w_i; the step time grows with lam; the range lets the most weighted lever
    # move by up to 1e4 either way (a run 2x off in compute alone needs lam of log 2 / w_compute)
    high = math.log(1e4) / max(weights.values())
    low = -high
    reached = simulated(low) <= measured_s <= simulated(high)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if simulated(mid) < measured_s else (low, mid)
    lam = (low + high) / 2
    new = apply_levers(profile, scales(lam))
    levers = {lever: s for lever, s in scales(lam).items() if abs(math.log(s)) > 1e-4}
    return new, {"levers": levers, "elasticities": {k: v for k, v in e.items() if v > 0}, "reached": reached,
                 "step_time_s_before": before, "step_time_s_after": step_s(new), "measured_step_time_s": measured_s,
                 "changed": changed_fields(profile, new)}


def changed_fields(old: CalibrationProfile, new: CalibrationProfile) -> dict[str, list[float]]:
    """{field: [before, after]} of every lever field that moved (collective_scale entries as collective_scale.op)."""
    out: dict[str, list[float]] = {}
    for fields in LEVER_FIELDS.values():
        for k in fields:
            a, b = getattr(old, k), getattr(new, k)
            if a != b and abs(math.log(max(b, 1e-300) / max(a, 1e-300))) > 1e-4:
                out[k] = [a, b]
    for op in sorted(set(old.collective_scale) | set(new.collective_scale)):
        a, b = old.collective_scale.get(op, 1.0), new.collective_scale.get(op, 1.0)
        if abs(math.log(b / a)) > 1e-4:
            out[f"collective_scale.{op}"] = [a, b]
    return out


def describe(info: dict[str, Any]) -> str:
    """One line: how much each part moved (x1.30 = that part takes 30% longer than the profile said)."""
    parts = ", ".join(f"{lever} x{s:.3f}" for lever, s in sorted(info["levers"].items(), key=lambda kv: -abs(
        math.log(kv[1])))) or "nothing"
    fields = "; ".join(f"{k} {_fmt(k, a)} -> {_fmt(k, b)}" for k, (a, b) in info.get("changed", {}).items())
    return (f"{parts} (simulated step {info['step_time_s_before']:.4g} s -> {info['step_time_s_after']:.4g} s, "
            f"measured {info['measured_step_time_s']:.4g} s)"
            + ("" if info["reached"] else "; the measurement is out of the model's reach")
            + (f"; fields: {fields}" if fields else ""))


def _fmt(key: str, value: float) -> str:
    return f"{value * 1e6:.0f} us" if key.endswith("_s") else f"{value:.3g}"
