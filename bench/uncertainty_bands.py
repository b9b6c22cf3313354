"""Uncertainty bands: what every accuracy bench measures, per engine, GPU family and dense/MoE.

Each accuracy bench scores the simulator against measured step times of one stack on one
kind of GPU. This script runs their scoring (the same functions their tests call, nothing
fitted here), groups the per-row errors by the engine meshplan plans that stack as, the GPU
family and whether the model is a mixture of experts, and writes planner/accuracy/bands.json,
from which `plan` prints a band beside each prediction ("not validated" where no group
covers the plan). A group's band is the 90th percentile of |error| over its rows held out of
every fit when it has at least MIN_HELD_OUT of them, else over all its rows (the JSON says
which); MAPE and bias are kept beside it.

Rows that measure a stack meshplan does not plan for are left out: MaxText and PaxML (JAX) in
the DGX Cloud table, and the LLM Foundry / NeMo rows of accuracy_published.py that repeat
the DGX Cloud rows (NeMo) are counted once.

    python bench/uncertainty_bands.py          # print the groups, write planner/accuracy/bands.json
    python bench/uncertainty_bands.py --check  # print only
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from planner.accuracy.bands import BANDS_PATH, band_family  # noqa: E402

MIN_HELD_OUT = 5  # held-out rows a band needs before the fitted rows are left out of it


@dataclass(frozen=True)
class Scored:
    bench: str  # the script (and source inside it) that measured the row
    engine: str  # the meshplan engine the stack is planned as
    gpu: str  # GPU name or family as the bench names it
    moe: bool
    row: str
    error: float  # predicted / measured - 1
    fitted: bool  # a shipped profile was fitted on this row


def vtrain_rows() -> list[Scored]:
    """vTrain's Megatron-DeepSpeed A100 runs; the A100 profile's 7 parameters were fitted on all of them."""
    import accuracy_vtrain as bench

    from planner.simulate.calibration import load_calibration
    from topologies.hardware import get_gpu

    profile = load_calibration(None, get_gpu("a100-80g-sxm"))
    out = []
    for kind in bench.FILES:
        rows = bench.load_rows(kind)
        out += [Scored(f"accuracy_vtrain.py ({kind})", "megatron", "a100", False, f"{kind}-{i}", e, True)
                for i, e in enumerate(bench.errors(rows, profile))]
    return out


def paper_rows() -> list[Scored]:
    """Narayanan 2021, Korthikanti 2022 (megatron) and MT-NLG (deepspeed) on A100; nothing fitted on them."""
    import accuracy_megatron_papers as bench

    rows = bench.load_rows()
    return [Scored(f"accuracy_megatron_papers.py ({r.bench['source']})", r.plan.engine, "a100", False,
                   f"{r.bench['source']} {r.id}", e, False) for r, e in zip(rows, bench.errors(rows), strict=True)]


def published_rows() -> list[Scored]:
    """LLM Foundry's PyTorch FSDP tables on H100, planned as engine meshplan (the NeMo rows: see dgxc_rows)."""
    import accuracy_published as bench

    from planner.simulate.calibration import load_calibration
    from topologies.hardware import get_gpu

    profile = load_calibration(None, get_gpu("h100-sxm"))
    rows = [r for r in bench.load_rows() if r.in_mape and r.source == "llm-foundry"]
    return [Scored("accuracy_published.py (llm-foundry)", r.row.plan.engine, r.row.plan.cluster.gpu.name, False, r.id, e,
                   r.split == "fit") for r, e in zip(rows, bench.errors(rows, profile), strict=True)]


def dgxc_rows() -> list[Scored]:
    """NVIDIA DGX Cloud NeMo runs (H100, GB200); MaxText and PaxML are JAX stacks and left out."""
    import accuracy_dgxc as bench

    profiles = bench.profiles()
    rows = [r for r in bench.load_dense_rows() if r.expressible and r.source == "nemo"
            and bench.split(r) in ("fit", "validate")]
    return [Scored("accuracy_dgxc.py (nemo)", r.engine, r.gpu, False, r.id, bench.error(r, profiles),
                   bench.split(r) == "fit") for r in rows]


def holdout_rows() -> list[Scored]:
    """Megatron-Bridge / NeMo performance summaries (dense and MoE) and torchtitan's published runs."""
    import accuracy_holdout as bench

    rows = bench.load_rows()
    bad = bench.inconsistent(rows)
    errs = bench.errors(rows)
    return [Scored(f"accuracy_holdout.py ({r.source})", r.engine, r.gpu, bool(r.moe), r.id, errs[r.id][0],
                   bench.fitted(r)) for r in rows if r.id in errs and r.id not in bad]


def torchtitan_rows() -> list[Scored]:
    """torchtitan's own H100 tables; the power-cap share was fitted on one row."""
    import accuracy_torchtitan_h100 as bench

    from topologies.errors import MeshplanError

    out = []
    for row in bench.ROWS:
        try:
            step = bench.simulate(row).step_time_s
        except MeshplanError:
            continue
        out.append(Scored("accuracy_torchtitan_h100.py", "torchtitan", "h100", False, row.id,
                          step / row.measured_s - 1.0, row.id == bench.FIT_ROW))
    return out


def collect() -> list[Scored]:
    return vtrain_rows() + paper_rows() + published_rows() + dgxc_rows() + holdout_rows() + torchtitan_rows()


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `share` of the values at or below it."""
    ordered = sorted(values)
    rank = math.ceil(share * len(ordered) - 1e-9)
    return ordered[max(rank, 1) - 1]


def bands(rows: list[Scored]) -> list[dict]:
    groups: dict[tuple[str, str, bool], list[Scored]] = {}
    for r in rows:
        # a band describes the engine across the releases its rows ran (planner.accuracy.bands.band_for)
        groups.setdefault((r.engine.split("@")[0], band_family(r.gpu), r.moe), []).append(r)
    out = []
    for (engine, family, moe), rs in sorted(groups.items()):
        held = [r for r in rs if not r.fitted]
        used = held if len(held) >= MIN_HELD_OUT else rs
        errs = [r.error for r in used]
        out.append({
            "engine": engine, "gpu_family": family, "moe": moe, "rows": len(used),
            "held_out": not any(r.fitted for r in used),
            "fitted_rows_left_out": len(rs) - len(used),
            "p90_abs_error": round(percentile([abs(e) for e in errs], 0.9), 4),
            "mape": round(sum(map(abs, errs)) / len(errs), 4), "bias": round(sum(errs) / len(errs), 4),
            "worst": round(max(errs, key=abs), 4), "benches": sorted({r.bench for r in used}),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="print the groups without writing the JSON")
    args = parser.parse_args()
    table = bands(collect())
    print(f"{'engine':<11} {'GPU':<7} {'MoE':<4} {'rows':>4} {'held out':>8} {'p90 |err|':>9} {'MAPE':>6} "
          f"{'bias':>6} {'worst':>7}  benches")
    for b in table:
        print(f"{b['engine']:<11} {b['gpu_family']:<7} {'yes' if b['moe'] else 'no':<4} {b['rows']:>4} "
              f"{'yes' if b['held_out'] else 'no':>8} {100 * b['p90_abs_error']:8.1f}% {100 * b['mape']:5.1f}% "
              f"{100 * b['bias']:+5.1f}% {100 * b['worst']:+6.1f}%  {', '.join(b['benches'])}")
    if args.check:
        return
    doc = {"written_by": "bench/uncertainty_bands.py", "date": datetime.date.today().isoformat(),
           "band": "90th percentile of |predicted / measured - 1| step time over the group's rows",
           "min_held_out": MIN_HELD_OUT, "bands": table}
    BANDS_PATH.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {BANDS_PATH.relative_to(REPO)}")


if __name__ == "__main__":
    main()
