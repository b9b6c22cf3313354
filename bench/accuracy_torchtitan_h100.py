"""torchtitan's own H100 benchmarks against `--engine torchtitan`: FSDP, compile, float8, CP, 2D, 3D, 4D.

Source: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch
1963fc8, torchao eab345c, torchtitan 9dec370; December 2024), tables 1-6:
Llama 3.1 8B, 70B and 405B on 8 to 512 GPUs, TPS/GPU at step 90 and the
largest memory across GPUs (torchtitan logs the caching allocator's reserved
peak). Every row: FSDP2 (ZeRO-3) with bf16 parameters reduced in fp32,
sequence 8192 unless the table says, global batch = local batch x FSDP
degree. Recipes as the tables state; what they leave to torchtitan's defaults
at 9dec370: float8 = torchao tensorwise with float8 all-gather (the 405B
train config), pipeline micro-batches = the pp degree
(pipelining_utils.build_pipeline_schedule), layers split evenly with the
remainder on the middle stages (generate_split_points; planner.layout.balanced_layers
gives the same split while the remainder fits the middle stages, as on every row
here), two stages per rank for interleaved 1F1B, no gradient accumulation outside pipelining.

Rows: bench/rows/torchtitan-h100 (`--engine torchtitan@2024-12 --cluster
bench/clusters/grand-teton-h100.toml`; `meshplan simulate` any of them).

The hardware is not a catalogued part: Grand Teton hosts whose H100s carry
96 GB of HBM2e at 2.4 TB/s and run at the default 500 W power limit (the
catalogued H100 SXM: 80 GB of HBM3 at 3.35 TB/s, 700 W), 400 Gbit/s per GPU
between hosts. Memory size and bandwidth are the source's. What the 500 W cap
leaves of the tensor-core rate is published nowhere, so it is the one fitted
number: bench/fit.py grand-teton fits the sustained FLOP/s fraction on table 1's
eager FSDP row alone and writes the rates it gives into the cluster file
bench/clusters/grand-teton-h100.toml (its record beside it, grand-teton-h100.fit.json);
every other row is scored with it (compile, float8, 128 GPUs, context
parallelism, TP, pipelining never seen by the fit).

    python bench/accuracy_torchtitan_h100.py          # per-row error with the shipped fraction
    python bench/accuracy_torchtitan_h100.py --fit    # fit the fraction on the one row, score with it (writes nothing)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import rowset  # noqa: E402

from planner.cli.row import Row  # noqa: E402
from planner.layout import balanced_layers  # noqa: E402, F401 (the split torchtitan generates: tests read it here)
from topologies.cluster_load import load_cluster  # noqa: E402
from topologies.errors import MeshplanError  # noqa: E402
from topologies.hardware import GIB, get_gpu  # noqa: E402

SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
          "(torchtitan 9dec370, torch 1963fc8, torchao eab345c)")
CLUSTER = REPO / "bench" / "clusters" / "grand-teton-h100.toml"
GRAND_TETON = load_cluster(str(CLUSTER), 8).gpu
# Tensor-core FLOP/s the 500 W cap sustains, as a share of the 700 W part's rated peak: the cluster file's
# gpu_bf16_tflops / gpu_fp8_tflops are the H100 SXM's times it, fitted on FIT_ROW only
POWER_CAP_FLOPS_FRACTION = round(GRAND_TETON.bf16_flops / get_gpu("h100-sxm").bf16_flops, 6)
ENGINE = "torchtitan@2024-12"  # 9dec370, the benchmark's commit (planner.engines.torchtitan)
TARGET_MAPE = 0.12  # the dense target of bench/accuracy_holdout.py, on rows the fit never saw
ROWS: list[Row] = rowset.rows("torchtitan-h100")
FIT_ROW = next(r.id for r in ROWS if r.bench["fit"])


def fraction_flags(fraction: float) -> tuple[str, ...]:
    """The cluster file at another power-cap fraction: `--set` what-ifs of its two tensor-core rates."""
    h100 = get_gpu("h100-sxm")
    return ("--set", f"gpu_bf16_tflops={h100.bf16_flops * fraction / 1e12}",
            "--set", f"gpu_fp8_tflops={h100.fp8_flops * fraction / 1e12}")


def simulate(row: Row, fraction: float = POWER_CAP_FLOPS_FRACTION):
    """The row as `meshplan simulate` predicts it; another fraction than the cluster file's as --set what-ifs."""
    extra = () if fraction == POWER_CAP_FLOPS_FRACTION else fraction_flags(fraction)
    return rowset.predict(row, extra=extra)


def fit_fraction(row: Row) -> float:
    """The power-cap FLOP/s fraction at which `row`'s predicted step equals the measured one (bisection)."""
    lo, hi = 0.4, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if simulate(row, mid).step_time_s > row.measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def report(fraction: float) -> dict[str, tuple[float, float]]:
    """Print every row; {row id: (step-time error, memory error)}."""
    print(f"H100 at 500 W: {fraction:.3f} of the rated tensor-core FLOP/s; HBM2e "
          f"{GRAND_TETON.memory_gbytes_per_s:.0f} GB/s, {GRAND_TETON.memory_bytes / GIB:.1f} GiB "
          f"({CLUSTER.relative_to(REPO)}). Source: {SOURCE}")
    print(f"{'row':<26} {'measured s':>10} {'predicted':>9} {'error':>7}   {'memory GiB':>10} {'predicted':>9} "
          f"{'error':>7}")
    out = {}
    for row in ROWS:
        try:
            result = simulate(row, fraction)
        except MeshplanError as exc:
            print(f"{row.id:<26} {row.measured_s:10.3f}   not expressible: {exc}")
            continue
        err = result.step_time_s / row.measured_s - 1
        mem = result.memory.peak_bytes / GIB
        measured_gib = row.measured["peak_memory_gib"]
        mem_err = mem / measured_gib - 1
        out[row.id] = (err, mem_err)
        tag = "  (fitted)" if row.id == FIT_ROW else ""
        print(f"{row.id:<26} {row.measured_s:10.3f} {result.step_time_s:9.3f} {100 * err:+6.1f}%   "
              f"{measured_gib:10.1f} {mem:9.1f} {100 * mem_err:+6.1f}%{tag}")
    held = {k: v for k, v in out.items() if k != FIT_ROW}
    for label, index in (("step time", 0), ("peak memory", 1)):
        errs = [v[index] for v in held.values()]
        worst = max(held, key=lambda k: abs(held[k][index]))
        print(f"{label:>12}: {len(errs)} held-out rows, MAPE {100 * sum(map(abs, errs)) / len(errs):.1f}%, "
              f"bias {100 * sum(errs) / len(errs):+.1f}%, worst {100 * held[worst][index]:+.1f}% ({worst})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true", help="fit the power-cap fraction on the fit row and score with "
                                                           "it (writes nothing: bench/fit.py grand-teton writes it)")
    args = parser.parse_args()
    fraction = POWER_CAP_FLOPS_FRACTION
    if args.fit:
        fraction = fit_fraction(next(r for r in ROWS if r.id == FIT_ROW))
        print(f"fitted on {FIT_ROW}: {fraction:.4f} (shipped {POWER_CAP_FLOPS_FRACTION})")
    report(fraction)


if __name__ == "__main__":
    main()
