"""CalibrationProfile: the few measured numbers that turn spec sheets into step times.

The simulator prices work from the GPU's spec sheet (peak FLOP/s, HBM
bandwidth) and the topology's link figures, scaled by the efficiencies below.
Each parameter is interpretable on its own and can be measured directly
(`meshplan calibrate`) or fitted once against published step times
(`bench/fit.py` writes the profiles shipped under `planner/simulate/calibrations/`,
read as package data, each fitted field with its fit's record in `fits`: the rows,
the error on them and on held-out rows, the date). No parameter is ever fitted per layout.

How each field enters the time model (see `planner.simulate.compute`):
  GEMM [m,k]x[k,n]:  t = 2mnk / (peak * gemm_efficiency) * (1 + gemm_knee/m + gemm_knee/n + gemm_knee/k)
      A dimension equal to `gemm_knee` doubles the time a large GEMM of the same
      FLOPs would take: tile quantization and pipeline fill of small dimensions
      (TP shrinks n or k by the TP degree, a micro-batch of 1 shrinks m).
  8-bit GEMMs:       the same formula at the GPU's FP8 (MXFP8) peak with
      `fp8_gemm_efficiency` in place of gemm_efficiency (a fraction of the 8-bit peak),
      plus the operand casts as memory-bound work (planner.simulate.compute)
  fused attention:   t = executed FLOPs / (peak * attention_efficiency)
  memory-bound work: t = bytes / (HBM bandwidth * memory_efficiency)
  host overhead:     a dense layer with fused attention costs `layer_overhead_s` of
      host time per forward pass; other layers scale it by the operations they
      dispatch (`planner.simulate.launches`: MLA, routers, token dispatch,
      per-expert GEMMs, CUDA graph replays), so layer_overhead_s / 16 is the
      host's cost per operation (twice per backward pass, three times with full recomputation) plus
      `collective_overhead_s` per collective it issues; GPU work (compute and
      the exposed communication) and host work of one pass overlap, combined as
      a p-norm: t = (t_gpu^p + t_host^p)^(1/p) with p = `overlap_exponent`
      (p -> inf: perfect overlap, the max; p = 1: serial). Collectives outside
      the layers (DP, p2p) pay `collective_overhead_s` in full.
      Two engine mechanisms add host work of their own (`planner.simulate.host`):
      under TP every operator on a DTensor pays `dtensor_op_overhead_s` (sharding
      propagation, redistribution planning, wrapping the local result), with
      `dtensor_ops_forward` / `dtensor_ops_backward` such operators per TP-split
      linear and pass; every FSDP all-gather and reduce-scatter pays
      `fsdp_call_overhead_s` beyond `collective_overhead_s` (FSDP2's copy-in,
      copy-out and hooks). A layout without TP or FSDP never pays them, so what
      is learnt about them does not move DDP's prediction.
  solo speed:        `solo_speedup` is how much faster a rank's kernels run while the
      other ranks sharing its cores idle than while all compute at once (1 on
      GPUs: every rank owns its device; > 1 on CPU ranks that share memory
      bandwidth, caches and cores). A pipeline stage that computes while its
      peer waits (warm-up, cool-down, bubbles) runs at that speed.
  collectives:       `topologies.collectives.CollectiveModel` with `link_efficiency`
      overriding its share of raw bandwidth per link class (nvlink, nvls, pcie,
      net, shm) and `latency_scale` scaling its hop and launch latencies.
  shared cores:      `comm_overlap` is the share of a collective that can run
      under the same rank's compute: 1 where the links have their own engines
      (GPU copy engines, NCCL's SMs beside the compute), 0 where a rank's
      collectives run on the cores that compute (CPU ranks with one core
      each, gloo's threads). Only the part that does not fit under the
      compute's `comm_overlap` share is exposed (DP buckets, FSDP prefetch,
      TP backward overlap, the CP ring).
  per collective:    `collective_scale[op]` multiplies the collective model's time
      of one operation: what the alpha-beta ring model misses of a backend's
      own algorithm (gloo reduce-scatters through a full all-reduce, say);
      fitted per operation by `meshplan calibrate`, refined by
      `report --update-calibration`.
  engines:           `engine_factors[engine]` multiplies compute efficiencies
      for one training engine (`for_engine`, which simulate_step applies). On
      H100 the GEMMs are cuBLAS's in every stack, but eager PyTorch (meshplan's
      FSDP2 executor, LLM Foundry's FSDP) runs its attention kernel at ~2/3 of
      Transformer Engine's rate and its unfused norms and activations at ~2/5 of
      the memory-bound rate. Factors are <= 1, so the base stays the fastest
      stack and a bound priced on the base never exceeds a simulated step.
      A shipped profile without factors for an engine may borrow those that
      describe software rather than silicon from another family's profile
      (`_TRANSFERRED_FACTORS`: the A100 takes the H100's memory-bound factor).

What each shipped profile reproduces, on the rows it was fitted on and on rows it
never saw, is in its `fits` records and the README's accuracy section.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from topologies.errors import TopologyError, UsageError
from topologies.hardware import GPUSpec, get_gpu

# Shipped profiles are package data beside this loader; a source checkout and an
# installed wheel both expose them as a directory on disk.
CALIBRATION_DIR = Path(str(resources.files(__package__) / "calibrations"))
_FRACTIONS = ("gemm_efficiency", "attention_efficiency", "memory_efficiency",
              "fp8_gemm_efficiency")  # also what engine_factors scale
_NON_NEGATIVE = ("gemm_knee", "layer_overhead_s", "latency_scale", "collective_overhead_s",
                 "optimizer_bytes_per_param", "dtensor_op_overhead_s", "dtensor_ops_forward",
                 "dtensor_ops_backward", "fsdp_call_overhead_s")


@dataclass(frozen=True)
class CalibrationProfile:
    """Efficiencies of one GPU kind and software stack (validated on construction)."""

    gpu: str = ""  # GPU name the profile was measured on ("" = generic defaults)
    gemm_efficiency: float = 0.80  # fraction of dense peak large GEMMs reach
    gemm_knee: float = 64.0  # GEMM dimension at which that dimension doubles the time
    # fraction of the 8-bit dense peak large FP8/MXFP8 GEMMs reach (cuBLASLt FP8 on H100: ~60-70%)
    fp8_gemm_efficiency: float = 0.60
    attention_efficiency: float = 0.55  # fused (flash) attention, fraction of peak on executed FLOPs
    memory_efficiency: float = 0.80  # fraction of HBM bandwidth memory-bound kernels reach
    # Host overhead describes the software stack and its host CPU: 16 operations of a reference dense
    # layer at ~30 us each on x86 (TE module calls, torch operators; the vTrain fit of Megatron-DeepSpeed
    # found 0.58 ms and p = 4.3); Grace hosts pay ~2.75x per operation (gb200.json)
    layer_overhead_s: float = 5e-4  # host time of a reference dense layer per forward pass (kernel launches, Python)
    overlap_exponent: float = 4.0  # p of the p-norm combining GPU and host time of a pass
    link_efficiency: dict[str, float] = field(default_factory=dict)  # overrides topologies.links.EFFICIENCY
    latency_scale: float = 1.0  # scales the topology model's hop latencies (nccl-tests based)
    collective_overhead_s: float = 0.0  # host cost of issuing one collective
    # DTensor (TP) and FSDP2 host work, see the module docstring; op counts per TP-split linear are
    # what torch 2.13's ColwiseParallel / RowwiseParallel dispatch (`meshplan calibrate` counts them)
    dtensor_op_overhead_s: float = 0.0  # host time of one operator dispatched on DTensors
    dtensor_ops_forward: float = 4.0  # DTensor operators per TP-split linear, forward pass
    dtensor_ops_backward: float = 9.0  # ... and backward pass
    fsdp_call_overhead_s: float = 0.0  # host time of one FSDP all-gather or reduce-scatter beyond the collective's
    solo_speedup: float = 1.0  # kernel speed of a rank alone over all ranks sharing its cores computing at once
    comm_overlap: float = 1.0  # share of a collective that can hide under the same rank's compute
    collective_scale: dict[str, float] = field(default_factory=dict)  # op -> factor on the model's time
    optimizer_bytes_per_param: float = 36.0  # HBM traffic of one AdamW update per local parameter
    other_bytes: int | None = None  # fixed memory overhead per GPU (None: the memory model's default)
    # Mixture of experts (planner.simulate.compute.moe_times, planner.simulate.comm): grouped GEMMs of
    # several routed experts on a rank as a fraction of the dense GEMM rate (one expert is a plain GEMM),
    # the busiest expert rank's tokens over the balanced share (dropless routing; a capacity factor caps
    # it), and the all-to-all's achieved share of the collective model's time at MoE message sizes (many
    # small per-peer messages), inside the NVLink domain and for groups that cross the network.
    grouped_gemm_efficiency: float = 1.0
    moe_imbalance: float = 1.0
    all_to_all_efficiency: float = 1.0
    all_to_all_net_efficiency: float = 1.0
    # routed-expert GEMMs under an 8-bit precision as a fraction of the block GEMMs' 8-bit rate: each
    # expert's operands are scaled and cast on their own (per-tensor FP8 on Hopper, MXFP8 on Blackwell)
    fp8_expert_efficiency: float = 1.0
    # engine -> {efficiency field: factor in (0, 1]}: how much slower that engine's kernels run than the base
    engine_factors: dict[str, dict[str, float]] = field(default_factory=dict)
    # {GPU name: sustained FLOP/s per SM of that member of the family over the fitted GPU's}, where runs on
    # it measured more than the equal rate per SM `per_sm_transfer` assumes (absent: 1)
    part_sm_rate: dict[str, float] = field(default_factory=dict)
    source: str = "defaults"  # where the numbers come from
    date: str = ""  # when they were measured or fitted (ISO date)
    # {fit name: record} of the fits that wrote this profile's numbers (bench/fit.py): "fields" (each fitted
    # field by path, planner.simulate.fit_records, and its value), "rows" (the row ids fitted on, by
    # bench/rows folder), "error" and "held_out" (MAPE, bias, rows and worst rows), "held_out_rows", "date",
    # "command". `save` drops a record once one of its fields no longer holds its value.
    fits: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("gpu", "source", "date"):
            if not isinstance(getattr(self, key), str):
                raise UsageError(f"calibration: {key} must be a string, got {getattr(self, key)!r}")
        for key in ("link_efficiency", "engine_factors"):
            if not isinstance(getattr(self, key), dict):
                raise UsageError(f"calibration: {key} must be an object, got {getattr(self, key)!r}")
        for key in (*_FRACTIONS, *_NON_NEGATIVE, "overlap_exponent"):
            value = getattr(self, key)
            # JSON's NaN and Infinity parse as floats, and NaN passes every range test below
            if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
                raise UsageError(f"calibration: {key} must be a finite number, got {value!r}")
        for key in _FRACTIONS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.5:
                raise UsageError(f"calibration: {key} must be a fraction in (0, 1.5], got {value!r}")
        for key in _NON_NEGATIVE:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or value < 0:
                raise UsageError(f"calibration: {key} must be a non-negative number, got {value!r}")
        for key, low, high in (("grouped_gemm_efficiency", 0.01, 1.0), ("moe_imbalance", 1.0, 16.0),
                               ("all_to_all_efficiency", 0.01, 1.0), ("all_to_all_net_efficiency", 0.01, 1.0),
                               ("fp8_expert_efficiency", 0.01, 1.0), ("solo_speedup", 1.0, 16.0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise UsageError(f"calibration: {key} must be a number in [{low}, {high}], got {value!r}")
        if not isinstance(self.overlap_exponent, (int, float)) or self.overlap_exponent < 1.0:
            raise UsageError(f"calibration: overlap_exponent must be >= 1, got {self.overlap_exponent!r}")
        from topologies.links import EFFICIENCY

        for key, value in self.link_efficiency.items():
            if key not in EFFICIENCY or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise UsageError(
                    f"calibration: link_efficiency[{key!r}] = {value!r}; keys are {sorted(EFFICIENCY)}, "
                    "values fractions in (0, 1]"
                )
        if self.other_bytes is not None and (not isinstance(self.other_bytes, int) or self.other_bytes < 0):
            raise UsageError(f"calibration: other_bytes must be a non-negative integer or null, got {self.other_bytes!r}")
        self._check_engine_factors()
        self._check_shared_core_fields()
        if not isinstance(self.part_sm_rate, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0.5 <= v <= 2.0
                for k, v in self.part_sm_rate.items()):
            raise UsageError(f"calibration: part_sm_rate must map GPU names to factors in [0.5, 2], "
                             f"got {self.part_sm_rate!r}")
        self._check_fits()
        object.__setattr__(self, "_by_engine", {})  # for_engine's results (simulate_step asks on every call)

    def _check_fits(self) -> None:
        if not isinstance(self.fits, dict):
            raise UsageError(f"calibration: fits must map fit names to records, got {self.fits!r}")
        for name, record in self.fits.items():
            if not (isinstance(record, dict) and isinstance(record.get("fields"), dict)
                    and isinstance(record.get("rows"), dict) and isinstance(record.get("date"), str)):
                raise UsageError(f"calibration: fits[{name!r}] must hold fields (path -> value), rows (folder -> "
                                 f"row ids) and date, got {record!r}")
            names = {f.name for f in dataclasses.fields(self)}
            for path in record["fields"]:
                if not isinstance(path, str) or path.split(".")[0] not in names:
                    raise UsageError(f"calibration: fits[{name!r}] names {path!r}, not a profile field")

    def _check_engine_factors(self) -> None:
        from planner.engines import ENGINE_NAMES as ENGINES

        for engine, factors in self.engine_factors.items():
            if engine not in ENGINES or not isinstance(factors, dict):
                raise UsageError(f"calibration: engine_factors keys are engines {ENGINES} mapping to objects, "
                                 f"got {engine!r}: {factors!r}")
            for key, value in factors.items():
                if key not in _FRACTIONS or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                    raise UsageError(f"calibration: engine_factors[{engine!r}][{key!r}] = {value!r}; keys are "
                                     f"{list(_FRACTIONS)}, values factors in (0, 1] (an engine is never faster "
                                     "than the base: search bounds are priced on the base)")

    def _check_shared_core_fields(self) -> None:
        from topologies.collectives import OPS

        if not isinstance(self.comm_overlap, (int, float)) or not 0.0 <= self.comm_overlap <= 1.0:
            raise UsageError(f"calibration: comm_overlap must be a fraction in [0, 1], got {self.comm_overlap!r}")
        if not isinstance(self.collective_scale, dict):
            raise UsageError(f"calibration: collective_scale must map collectives to factors, "
                             f"got {self.collective_scale!r}")
        for op, value in self.collective_scale.items():
            if op not in OPS or not isinstance(value, (int, float)) or not 0.0 < value <= 1e3:
                raise UsageError(f"calibration: collective_scale[{op!r}] = {value!r}; keys are {list(OPS)}, "
                                 "values factors in (0, 1000]")

    def for_engine(self, engine: str) -> CalibrationProfile:
        """The profile `engine` runs at: its factors applied to the base, no factors left (idempotent)."""
        if not self.engine_factors:
            return self
        if engine not in self._by_engine:
            factors = self.engine_factors.get(engine, {})
            self._by_engine[engine] = self.replace(engine_factors={}, **{k: getattr(self, k) * f
                                                                        for k, f in factors.items()})
        return self._by_engine[engine]

    def replace(self, **changes: Any) -> CalibrationProfile:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> CalibrationProfile:
        if not isinstance(data, dict):
            raise UsageError(f"a calibration profile must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"calibration profile has unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise UsageError(f"malformed calibration profile: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write the profile; fit records whose fields it no longer holds are dropped (they would lie)."""
        from planner.simulate.fit_records import holds
        from topologies.files import write_text
        from topologies.terminal import dumps_json

        held = {name: record for name, record in self.fits.items() if holds(self, record)}
        write_text(path, dumps_json(self.replace(fits=held).to_json()) + "\n", what="calibration profile")



# Defaults for GPU kinds without a measured profile file (literature, not fitted
# here: `meshplan calibrate` replaces them). Large dense bf16 GEMMs reach ~75-80%
# of peak on A100 (the vTrain fit: 82% in fp16) but only ~65-70% on Hopper (the
# H100 fit: 71%; power-capped clocks), which B200 is assumed to share;
# FlashAttention reaches 50-73% of peak on A100 and ~35-40% on H100 (Dao 2023;
# Shah et al. 2024); STREAM-like kernels ~80-90% of HBM.
_GENERIC = {
    "a100": dict(gemm_efficiency=0.80, attention_efficiency=0.55),
    "b200": dict(gemm_efficiency=0.65, attention_efficiency=0.35),
    # CPU ranks get one core each from the executor (OMP threads = cores / ranks): gloo's transfers
    # and the Python that issues the kernels run on the core that computes, so nothing hides
    # (comm_overlap 0) and host and kernel time add up (overlap_exponent 1).
    "cpu": dict(gemm_efficiency=0.50, attention_efficiency=0.30, layer_overhead_s=1e-3, gemm_knee=16.0,
                comm_overlap=0.0, overlap_exponent=1.0),
}
# Families that share another's profile. H200 is the H100's GH100 die at the same
# clocks (989 TFLOP/s dense bf16 on both datasheets) with 141 GB of HBM3e at
# 4.8 TB/s instead of 80 GB at 3.35: the efficiencies carry over, and the faster
# memory enters through the GPU spec (memory-bound work, the optimizer step).
# No published bf16 H200 training table was found to check it against.
# H800 is the H100 die with fewer NVLinks: its compute profile is the H100's. B200, B300 and
# GB300 take GB200's Blackwell fit, carried over per tensor core (`per_sm_transfer`).
_DERIVED = {"h200": "h100", "h800": "h100", "b200": "gb200", "b300": "gb200", "gb300": "gb200"}
# Efficiencies whose work runs on the SMs at their clock (tensor-core GEMMs; attention's MMAs and
# the SFU exponentials), the ones `per_sm_transfer` carries per SM. Memory-bound work is not among them.
_CLOCKED = (("gemm_efficiency", "bf16"), ("attention_efficiency", "bf16"), ("fp8_gemm_efficiency", "fp8"))


def per_sm_transfer(profile: CalibrationProfile, source: GPUSpec, gpu: GPUSpec) -> CalibrationProfile:
    """`profile`, fitted on `source`, for another member of its family: the same sustained rate per SM.

    A spec sheet's peak is SMs x tensor-core FLOPs per clock x the part's rated
    clock, and the rated clock follows the form factor: the same 148-SM die is
    rated 4.5 PF dense FP8 as HGX B200 (1,000 W) and 5 PF in GB200 NVL72 (1,200 W);
    Blackwell Ultra's 160 SMs are rated 4.5 PF in HGX B300 and 5 PF in GB300 NVL72
    (per-GPU tables of the DGX B200, GB200 NVL72, DGX B300 and GB300 NVL72
    datasheets; NVIDIA technical blog "Inside NVIDIA Blackwell Ultra", 2025, for
    the 160 SMs). Training never runs at the rated clock (the GB200 fit reaches
    0.46-0.50 of it), and the published runs show the sustained rate follows the
    SMs, not the rating: on the same recipe and layout the x86 B200 ran Llama 3 8B
    at 96-99% of GB200's tokens/s (rated 90%) and B300 ran Qwen3-30B-A3B at 97%
    of GB300's (rated 90%; Megatron-Bridge performance summaries, 25.09-26.02,
    bench/data/nemo_perf_summary.json). So each clocked efficiency is scaled by
    the source's rated FLOP/s per SM over this GPU's: the same FLOP/s per SM.
    Parts with the same rated rate per SM (H200 and H800 against H100) keep the
    profile as fitted; a GPU without catalogued SMs keeps it too.

    Where runs on a part measured a different rate per SM, `part_sm_rate` names
    it: the GB200 profile's Blackwell Ultra factor (gb300, b300), Ultra's
    sustained FLOP/s per SM over Blackwell's, is fitted by
    bench/fit.py blackwell-ultra on the 25.11 GB300 dense rows and scored on the
    rest (no spec sheet gives it: equal dense peaks, HBM and NVLink).
    """
    if source.name == gpu.name or not (source.sm_count and gpu.sm_count):
        return profile
    part = profile.part_sm_rate.get(gpu.name, 1.0)
    changes, notes = {}, []
    for key, dtype in _CLOCKED:
        ours, theirs = getattr(gpu, f"{dtype}_flops"), getattr(source, f"{dtype}_flops")
        if not (ours and theirs):
            continue
        scale = (theirs / source.sm_count) / (ours / gpu.sm_count) * part
        if abs(scale - 1.0) > 1e-9:
            changes[key] = min(1.5, getattr(profile, key) * scale)
            notes.append(f"{key} x{scale:.3f}")
    if not changes:
        return profile
    measured = f", {part:g} its measured rate per SM" if part != 1.0 else ""
    return profile.replace(**changes, source=f"{profile.source}; carried per SM from {source.name} "
                                             f"({source.sm_count} SMs) to {gpu.name} ({gpu.sm_count}{measured}): "
                                             f"{', '.join(notes)}")


def _source_gpu(profile: CalibrationProfile) -> GPUSpec | None:
    """The catalogued GPU a profile was fitted on, None where it names none or one not in the catalog."""
    if not profile.gpu:
        return None
    try:
        return get_gpu(profile.gpu)
    except TopologyError:
        return None


# Engine factors a profile fitted on one stack borrows from another family's profile, per kind of
# efficiency, where the factor is a property of the software and not of the silicon. The A100 profile
# is fitted on Megatron-DeepSpeed (vTrain), so it carries no factors of its own; PyTorch-native stacks
# (meshplan's executor, torchtitan) run there with:
# * the H100 memory factor: eager PyTorch splits a norm, SwiGLU, RoPE or residual add into several
#   elementwise kernels, each a full HBM round trip, where the fused stack makes one pass. The factor
#   is the ratio of bytes moved by the two kernel graphs, both at the memory-bound rate of whichever
#   GPU runs them, so it carries over as a ratio to the A100's own fitted memory_efficiency;
# * no attention factor: on H100 the factor is LLM Foundry's attention kernel (the rows the eager
#   factors are fitted on) against Transformer Engine's cuDNN kernels built on Hopper-only
#   instructions (wgmma, TMA); torchtitan's SDPA carries none even there (its own H100 tables,
#   bench/accuracy_torchtitan_h100.py). On A100 the stacks run FlashAttention-2-class kernels,
#   which the A100 attention_efficiency already describes.
# The stack the A100 profile was fitted on (deepspeed: Megatron-DeepSpeed) and megatron borrow nothing.
_TRANSFERRED_FACTORS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    # family: (source family, engines, efficiency fields)
    "a100": ("h100", ("meshplan", "torchtitan"), ("memory_efficiency",)),
}


def _transferred(profile: CalibrationProfile, family: str) -> CalibrationProfile:
    """`profile` with the engine factors `_TRANSFERRED_FACTORS` lends it; its own factors win."""
    if family not in _TRANSFERRED_FACTORS:
        return profile
    source_family, engines, keys = _TRANSFERRED_FACTORS[family]
    source = _read(CALIBRATION_DIR / f"{source_family}.json")
    factors = {engine: dict(profile.engine_factors.get(engine, {})) for engine in engines}
    lent = []
    for engine in engines:
        for key in keys:
            value = source.engine_factors.get(engine, {}).get(key)
            if value is not None and key not in factors[engine]:
                factors[engine][key] = value
                lent.append(f"{engine} {key} {value}")
    if not lent:
        return profile
    return profile.replace(engine_factors={**profile.engine_factors, **{e: f for e, f in factors.items() if f}},
                           source=f"{profile.source}; engine factors from the {source_family} profile "
                                  f"(software ratios, not fitted here): {', '.join(lent)}")


def _family(gpu_name: str) -> str:
    """Calibration family of a GPU name: its first word, derived families mapped to their source."""
    family = gpu_name.lower().split("-")[0]
    return _DERIVED.get(family, family)


@lru_cache(maxsize=64)
def default_calibration(gpu: GPUSpec) -> CalibrationProfile:
    """The shipped profile for this GPU family, else generic defaults (see `_GENERIC`); read once."""
    family = _family(gpu.name)
    path = CALIBRATION_DIR / f"{family}.json"
    if path.exists():
        profile = _read(path)
        source = _source_gpu(profile)
        if profile.gpu and profile.gpu != gpu.name:
            profile = profile.replace(source=f"{profile.source}; fitted on {profile.gpu}, used for {gpu.name}")
        if source is not None:
            profile = per_sm_transfer(profile, source, gpu)
        return _resolved(_transferred(profile, family).replace(gpu=gpu.name), gpu)
    generic = CalibrationProfile(gpu=gpu.name, source=f"generic defaults for {family}", **_GENERIC.get(family, {}))
    return _resolved(generic, gpu)


def _resolved(profile: CalibrationProfile, gpu: GPUSpec) -> CalibrationProfile:
    """Fill other_bytes from the memory model's default for this GPU when the profile leaves it null."""
    if profile.other_bytes is not None:
        return profile
    from planner.memory.estimate import default_other_bytes

    return profile.replace(other_bytes=default_other_bytes(gpu))


def load_calibration(path: str | Path | None, gpu: GPUSpec) -> CalibrationProfile:
    """`--calibration F`: a profile file, or None for the defaults of `gpu`.

    A profile measured on another GPU family is refused: its efficiencies
    describe other silicon and would silently mislead every prediction. The
    returned profile always has an integer other_bytes.
    """
    if path is None:
        return default_calibration(gpu)
    profile = _read(Path(path))
    if profile.gpu and _family(profile.gpu) != _family(gpu.name):
        raise UsageError(
            f"calibration {str(path)!r} was measured on {profile.gpu!r}, but the cluster has {gpu.name!r}: "
            "calibrate on this GPU (`meshplan calibrate`) or drop --calibration"
        )
    source = _source_gpu(profile)
    return _resolved(per_sm_transfer(profile, source, gpu) if source is not None else profile, gpu)


def _read(path: Path) -> CalibrationProfile:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"calibration file {str(path)!r} does not exist: create one with `meshplan calibrate`") from None
    except OSError as exc:
        raise UsageError(f"cannot read calibration file {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"calibration file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise UsageError(f"calibration file {str(path)!r} is not UTF-8 text: give the JSON `meshplan calibrate` "
                         "writes") from None
    except RecursionError:
        raise UsageError(f"calibration file {str(path)!r} is nested too deeply to be a profile") from None
    try:
        return CalibrationProfile.from_json(data)
    except UsageError as exc:
        raise UsageError(f"calibration file {str(path)!r}: {exc}") from None
