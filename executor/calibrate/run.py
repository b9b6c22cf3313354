"""`meshplan calibrate`: measure this machine with PyTorch and write a calibration profile.

Steps (each one a row of the progress bar on stderr):
  1. GEMMs over a grid of shapes, in the training dtype (bf16 on GPUs, fp32 on
     CPU) and, on the full GPU grid, fp16 and fp32 too (reported, not fitted:
     the profile has one GEMM efficiency, for the dtype plans train in);
  2. causal SDPA forward + backward (the executor's attention kernel);
  3. device-to-device copies (memory-bound work) and one AdamW step;
  4. one tiny transformer block forward (host overhead per layer);
  5. collectives over 2..N local ranks under torchrun (gloo on CPU, NCCL on GPUs)
     and, with --model on CPU, one block of that model plain, alone, under TP
     and under FSDP (`executor.calibrate.blocks`: DTensor's and FSDP's host
     costs, the solo speed of a rank whose peers idle).
Then `executor.calibrate.fit` fits the profile's parameters and the profile
is written to --out, with every raw sample beside it (<out>.samples.json) so a
fit can be audited or redone.

On CPU the kernels run as the executor's ranks do: max-ranks processes at
once, each with cores // ranks threads (`executor.calibrate.kernels`), so the
profile prices a rank that shares the machine; `comm_overlap` is 0 when every
core has a rank (gloo's transfers then run on the computing cores).
`--model` adds the shapes of that model's layouts (`executor.calibrate.shapes`).

Grids: "full" (default), "quick" (under 2 minutes on a 2-core CPU) and
"tiny" (seconds; for tests). Sizes differ per device: a 2-core CPU runs a
1024^3 GEMM in tens of milliseconds, a GPU needs 8192^3 to reach its peak.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topologies.errors import UsageError
from topologies.hardware import GIB, GPUSpec, get_gpu
from topologies.smi_topo import gpu_from_smi_name

# (gemm (m, n, k) list, attention (b, heads, s, d) list, copy sizes, adamw params, comm sizes)
_SQ = [(n, k) for n in (256, 1024) for k in (256, 1024)]
GRIDS: dict[tuple[str, str], dict[str, Any]] = {
    ("cpu", "tiny"): dict(gemm=[(32, 64, 64), (64, 128, 64), (128, 128, 128)], attention=[(1, 2, 64, 16)],
                          copy=[1 << 22], adamw=100_000, comm=[4096, 1 << 16]),
    ("cpu", "quick"): dict(gemm=[(m, n, k) for m in (16, 128, 1024) for n, k in _SQ],
                           attention=[(1, 4, 256, 64), (1, 4, 512, 64)], copy=[1 << 24, 1 << 26],
                           adamw=1 << 22, comm=[4096, 1 << 18, 1 << 22]),
    ("cpu", "full"): dict(gemm=[(m, n, k) for m in (16, 64, 256, 1024, 2048) for n in (256, 1024, 2048)
                                for k in (256, 1024, 2048)],
                          attention=[(1, 8, s, 64) for s in (256, 512, 1024)], copy=[1 << 24, 1 << 26, 1 << 28],
                          adamw=1 << 24, comm=[1 << p for p in range(12, 25, 2)]),
    ("cuda", "tiny"): dict(gemm=[(256, 1024, 1024), (1024, 1024, 1024), (4096, 4096, 4096)],
                           attention=[(1, 16, 1024, 128)], copy=[1 << 28], adamw=1 << 24, comm=[1 << 16, 1 << 24]),
    ("cuda", "quick"): dict(gemm=[(m, n, k) for m in (128, 1024, 8192) for n in (1024, 4096, 8192)
                                  for k in (1024, 4096, 8192)],
                            attention=[(b, 16, s, 128) for b, s in ((4, 1024), (2, 2048), (1, 4096))],
                            copy=[1 << 28, 1 << 30], adamw=1 << 26, comm=[1 << p for p in range(10, 29, 3)]),
    ("cuda", "full"): dict(gemm=[(m, n, k) for m in (64, 256, 1024, 4096, 16384) for n in (512, 2048, 8192)
                                 for k in (512, 2048, 8192)],
                           attention=[(b, h, s, d) for b, s in ((8, 1024), (4, 2048), (2, 4096), (1, 8192))
                                      for h, d in ((32, 64), (16, 128))],
                           copy=[1 << 26, 1 << 28, 1 << 30], adamw=1 << 27, comm=[1 << p for p in range(10, 31, 2)]),
}
EXTRA_DTYPES_FULL_GPU = ("fp16", "fp32")
@dataclass(frozen=True)
class Machine:
    device: str  # "cpu" | "cuda"
    gpu: GPUSpec
    dtype: str  # the dtype plans train in on this device, which the profile's GEMM efficiency is for
    max_ranks: int


def detect_machine(device: str | None, max_ranks: int | None) -> Machine:
    import torch

    has_cuda = torch.cuda.is_available()
    device = device or ("cuda" if has_cuda else "cpu")
    if device == "cuda":
        if not has_cuda:
            raise UsageError("--device cuda, but PyTorch sees no CUDA device: use --device cpu")
        gpu = gpu_from_smi_name(torch.cuda.get_device_name(0))  # same names as nvidia-smi prints
        count = torch.cuda.device_count()
        return Machine("cuda", gpu, "bf16" if gpu.bf16_flops > 0 else "fp16", min(max_ranks or count, count))
    cores = os.cpu_count() or 1
    return Machine("cpu", get_gpu("cpu"), "fp32", max_ranks or min(cores, 4))


def local_cluster(machine: Machine, n: int):
    """The cluster these n local ranks form, for the topology model the comm fit inverts."""
    from topologies.cluster import Cluster
    from topologies.cluster_load import load_cluster

    if machine.device == "cpu":
        return load_cluster("cpu", n)
    intra = "nvswitch" if machine.gpu.nvlink_gbytes_per_s > 0 and n > 2 else \
        "xgmi" if machine.gpu.xgmi_links >= n - 1 > 0 else "pcie"
    return Cluster(name="local", gpu=machine.gpu, gpus_per_node=n, intra_node=intra, nics_per_node=1)


def _steps(grid: dict[str, Any], machine: Machine, name: str) -> list[tuple[str, str, tuple]]:
    """(benchmark kind, dtype, arguments) for every single-device measurement of the grid."""
    dtypes = (machine.dtype,) + (EXTRA_DTYPES_FULL_GPU if machine.device == "cuda" and name == "full" else ())
    steps = [("gemm", dt, shape) for dt in dtypes for shape in grid["gemm"]]
    attn_dtype = machine.dtype if machine.device == "cuda" else "fp32"
    steps += [("attention", attn_dtype, shape) for shape in grid["attention"]]
    steps += [("copy", "", (size,)) for size in grid["copy"]]
    return steps + [("adamw", "fp32", (grid["adamw"],)), ("layer", "", ())]


def plan_steps(grid: dict[str, Any], machine: Machine, name: str, shapes: Any) -> tuple[list, dict[str, Any]]:
    """The benchmark steps with a plan's shapes added (`executor.calibrate.shapes`), and the grid they extend."""
    if shapes is None:
        return _steps(grid, machine, name), grid
    grid = {**grid, "gemm": list(dict.fromkeys([*shapes.gemm, *grid["gemm"]])), "attention": list(shapes.attention),
            "adamw": shapes.adamw_params, "comm": sorted({*grid["comm"], *shapes.comm_bytes})}
    return _steps(grid, machine, name), grid


def run_calibration(device: str | None = None, quick: bool = False, max_ranks: int | None = None,
                    out: Path | None = None, grid_name: str | None = None, model: Any = None,
                    seq_len: int | None = None, micro_batches: tuple[int, ...] = (1, 2), quiet: bool = False,
                    ) -> tuple[Any, dict[str, Any]]:
    """Measure, fit, write the profile (and its samples); returns (profile, summary).

    With `model` (a ModelSpec), the GEMMs, attention, AdamW and messages of its
    layouts on up to max_ranks ranks at `seq_len` and `micro_batches` join the
    grid, and the GEMM, attention and per-collective fits use those shapes only.
    A progress bar on a terminal follows the measurements (none with `quiet`).
    """
    import torch

    from executor.calibrate.comm import measure_collectives
    from executor.calibrate.fit import fit_profile, prediction_errors
    from executor.calibrate.kernels import measure_kernels, samples_from_times, threads_per_rank, usable_cores
    from executor.calibrate.shapes import plan_shapes
    from planner.simulate.calibration import default_calibration
    from planner.training import DTYPE_BYTES
    from topologies.terminal import Progress

    machine = detect_machine(device, max_ranks)
    name = grid_name or ("quick" if quick else "full")
    ranks = max(machine.max_ranks, 1)
    shapes = None
    if model is not None:
        shapes = plan_shapes(model, seq_len or min(model.max_seq_len, 4096), micro_batches, ranks,
                             DTYPE_BYTES[machine.dtype])
    steps, grid = plan_steps(GRIDS[(machine.device, name)], machine, name, shapes)
    cores = usable_cores()
    sharing = ranks if machine.device == "cpu" else 1  # GPUs: one rank per device, nothing shared
    threads = threads_per_rank(cores, ranks, os.environ.get("OMP_NUM_THREADS")) if machine.device == "cpu" else 1
    label = f"{machine.gpu.name}: kernels" + (f" ({sharing} ranks x {threads} threads at once)" if sharing > 1 else "")
    with Progress(label, total=len(steps), unit="measured", quiet=quiet) as progress:
        times = measure_kernels(steps, machine.device, sharing, threads,
                                on_progress=lambda done: progress.update(completed=done))
        progress.phase(f"collectives over 2..{machine.max_ranks} ranks" if machine.max_ranks > 1 else
                       "collectives: one rank, nothing to measure")
        block = (model, micro_batches[-1], seq_len or min(model.max_seq_len, 4096)) if model is not None else None
        comm, other, blocks = measure_collectives(
            machine.device, grid["comm"], machine.max_ranks, threads=threads, block=block,
            on_progress=lambda d, t: progress.update(completed=d, total=t))
    results, extra = samples_from_times(steps, times)
    if machine.device == "cuda" and other is None:
        dev = torch.device("cuda", 0)
        free, total = torch.cuda.mem_get_info(dev)
        other = int(total - free - torch.cuda.memory_reserved(dev))
    date = datetime.date.today().isoformat()
    plan_gemm = set(shapes.gemm) if shapes else set()
    fit_gemm = [s for s in results["gemm"] if (s.m, s.n, s.k) in plan_gemm] or results["gemm"]
    base = default_calibration(machine.gpu)
    if machine.device == "cpu":  # collectives and Python run on the computing cores when every core has a rank
        shared = sharing * threads >= cores
        base = base.replace(comm_overlap=0.0 if shared else 1.0, overlap_exponent=1.0 if shared else
                            base.overlap_exponent)
    what = f"{name} grid" + (f" + {model.name} shapes (seq {seq_len}, micro-batches {list(micro_batches)})"
                             if model is not None else "")
    profile = fit_profile(
        gpu=machine.gpu, dtype=machine.dtype, base=base, gemm=fit_gemm,
        attention=results["attention"], memory=results["copy"], adamw=extra["adamw"],
        layer_overhead_s=extra["layer_overhead_s"], comm=comm, cluster=local_cluster(machine, ranks),
        other_bytes=other, source=f"meshplan calibrate ({what}, {machine.device}, {sharing} ranks x {threads} "
        f"threads, torch {torch.__version__})", date=date,
        scale_sizes=tuple(shapes.comm_bytes) if shapes else None)
    if blocks:
        from executor.calibrate.fit import fit_blocks

        profile = profile.replace(**fit_blocks(profile, machine.gpu, machine.dtype, model,
                                               local_cluster(machine, ranks), blocks))
    errors = prediction_errors(profile, machine.gpu, machine.dtype, results["gemm"])
    summary = _summary(machine, name, results, comm, errors, profile)
    if out is not None:
        from topologies.files import is_regular_destination, write_text

        profile.save(out)
        samples = {k: [vars(s) for s in v] for k, v in results.items()}
        samples.update(comm=[vars(s) for s in comm], adamw=extra["adamw"], layer_overhead_s=extra["layer_overhead_s"],
                       other_bytes=other, summary=summary, sharing_ranks=sharing, threads_per_rank=threads,
                       blocks=blocks)
        if is_regular_destination(out):  # beside a file; a device or pipe gets the profile only
            write_text(Path(out).with_suffix(".samples.json"), json.dumps(samples, indent=1), what="samples")
    return profile, summary


def _summary(machine: Machine, grid: str, results: dict[str, list], comm: list, gemm_errors: list[float],
             profile: Any) -> dict[str, Any]:
    """What was measured, in the units people compare (TFLOP/s, GB/s), next to the fitted parameters."""
    from topologies.collectives import bus_bandwidth_gbytes_per_s

    gemm: dict[str, Any] = {}
    for s in results["gemm"]:
        tflops = s.flops / s.time_s / 1e12
        best = gemm.setdefault(s.dtype, {"best_tflops": 0.0, "peak_tflops": machine.gpu.peak_flops(s.dtype) / 1e12})
        best["best_tflops"] = max(best["best_tflops"], tflops)
    attention = max((s.flops / s.time_s / 1e12 for s in results["attention"]), default=None)
    copy = max((s.gbytes_per_s for s in results["copy"]), default=None)
    busbw: dict[str, float] = {}
    for s in comm:
        bw = bus_bandwidth_gbytes_per_s(s.op, s.n_ranks, s.size_bytes, s.time_s)
        busbw[f"{s.op} x{s.n_ranks}"] = max(busbw.get(f"{s.op} x{s.n_ranks}", 0.0), bw)
    return {
        "device": machine.device, "gpu": machine.gpu.name, "dtype": machine.dtype, "grid": grid,
        "gemm_tflops": gemm, "gemm_fit_max_abs_error": max(abs(e) for e in gemm_errors) if gemm_errors else None,
        "gemm_fit_median_abs_error": sorted(abs(e) for e in gemm_errors)[len(gemm_errors) // 2] if gemm_errors else None,
        "attention_best_tflops": attention, "copy_best_gbytes_per_s": copy,
        "hbm_gbytes_per_s_spec": machine.gpu.memory_gbytes_per_s, "comm_best_busbw_gbytes_per_s": busbw,
        "profile": profile.to_json(),
    }


def render_summary(summary: dict[str, Any], out: str) -> None:
    """Human view of a calibration: measured figures and the fitted profile."""
    from rich.table import Table

    from topologies.terminal import console

    p = summary["profile"]
    table = Table(title=f"calibration of {summary['gpu']} ({summary['device']}, {summary['grid']} grid) -> {out}")
    table.add_column("measured")
    table.add_column("value", justify="right")
    table.add_column("fitted parameter")
    table.add_column("value", justify="right")
    for dtype, g in summary["gemm_tflops"].items():
        table.add_row(f"GEMM {dtype} best", f"{g['best_tflops']:.2f} TFLOP/s of {g['peak_tflops']:.1f}",
                      "gemm_efficiency / knee" if dtype == summary["dtype"] else "",
                      f"{p['gemm_efficiency']:.3f} / {p['gemm_knee']:.0f}" if dtype == summary["dtype"] else "")
    if summary["gemm_fit_max_abs_error"] is not None:
        table.add_row("GEMM model error", f"median {100 * summary['gemm_fit_median_abs_error']:.0f}%, "
                      f"max {100 * summary['gemm_fit_max_abs_error']:.0f}%", "", "")
    if summary["attention_best_tflops"]:
        table.add_row("SDPA causal fwd+bwd", f"{summary['attention_best_tflops']:.2f} TFLOP/s",
                      "attention_efficiency", f"{p['attention_efficiency']:.3f}")
    if summary["copy_best_gbytes_per_s"]:
        table.add_row("device copy", f"{summary['copy_best_gbytes_per_s']:.1f} GB/s of "
                      f"{summary['hbm_gbytes_per_s_spec']:.0f}", "memory_efficiency", f"{p['memory_efficiency']:.3f}")
    table.add_row("", "", "optimizer_bytes_per_param", f"{p['optimizer_bytes_per_param']:.1f}")
    table.add_row("", "", "layer_overhead_s", f"{p['layer_overhead_s'] * 1e6:.0f} us")
    table.add_row("", "", "collective_overhead_s", f"{p['collective_overhead_s'] * 1e6:.0f} us")
    if p.get("dtensor_op_overhead_s"):
        table.add_row("", "", "dtensor_op_overhead_s (ops/linear)", f"{p['dtensor_op_overhead_s'] * 1e6:.0f} us "
                      f"({p['dtensor_ops_forward']:.0f} fwd, {p['dtensor_ops_backward']:.0f} bwd)")
    if p.get("fsdp_call_overhead_s"):
        table.add_row("", "", "fsdp_call_overhead_s", f"{p['fsdp_call_overhead_s'] * 1e6:.0f} us")
    table.add_row("", "", "solo_speedup", f"{p.get('solo_speedup', 1.0):.2f}")
    for key, bw in summary["comm_best_busbw_gbytes_per_s"].items():
        table.add_row(f"{key} busbw", f"{bw:.2f} GB/s", "", "")
    links = ", ".join(f"{k} {v:.2f}" for k, v in p["link_efficiency"].items())
    table.add_row("", "", "link_efficiency / latency_scale", f"{links or 'defaults'} / {p['latency_scale']:.2f}")
    scales = ", ".join(f"{op} x{v:.2f}" for op, v in p.get("collective_scale", {}).items())
    table.add_row("", "", "collective_scale", scales or "none")
    table.add_row("", "", "comm_overlap", f"{p.get('comm_overlap', 1.0):.2f}")
    if p.get("other_bytes") is not None:
        table.add_row("", "", "other_bytes", f"{p['other_bytes'] / GIB:.2f} GiB")
    console().print(table)
