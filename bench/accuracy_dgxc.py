"""Accuracy of the step-time model on NVIDIA's DGX Cloud dense runs: bf16 and FP8, H100 and GB200, three stacks.

Rows: bench/rows/dgxc (one file per run: the `meshplan plan` flags that state
it, what it measured; bench/rows/dgxc/README.md says what each stack is run
as, and which runs cannot be stated). Fitted, per GPU family and never per row:

* H100: only `fp8_gemm_efficiency` (the fraction of the FP8 peak that 8-bit
  GEMMs reach). The 16-bit parameters stay those fitted on NeMo 24.09 and
  LLM Foundry runs (bench/fit.py h100-bf16), so every bf16 row here is a
  hold-out row for them.
* GB200: `gemm_efficiency`, `fp8_gemm_efficiency` and `attention_efficiency`
  (--blackwell, BLACKWELL_SPLITS). One model's rows cannot separate attention
  from the GEMMs, so the fit also takes the Megatron-Bridge performance-summary
  GB200 dense rows of bench/accuracy_holdout.py (Llama 3 8B at 8K is
  attention-heavy, 405B is not): "both", the shipped profile. "dgxc" keeps
  the DGX Cloud rows alone with attention tied to the GEMMs in the H100
  ratio; "bridge" fits on the Megatron-Bridge rows alone, every DGX Cloud row
  unseen. B200, B300 and GB300 share the profile per SM (bench/fit.py
  blackwell-ultra fits Ultra's rate per SM on the 25.11 GB300 rows).
  bench/fit.py writes every fit; this bench only scores.

Hold-out by model: only the rows of FIT_MODELS (and their proxies, the same
model with fewer layers) are fitted; every other model and both JAX stacks
(MaxText, PaxML: never fitted, another software stack) are scored unseen.

Left out of the fit and the MAPE, and said so in the output: rows that
cannot be expressed, and INCONSISTENT rows (bench.inconsistent): Nemotron-4 340B in
v25.04 lists VP=NA, but a non-interleaved 8-stage pipeline with 16
micro-batches cannot run in the measured 4.36 s: the same layout with VP=12
in v25.05 takes 4.61 s; the row's configuration is taken to be misprinted.

    python bench/accuracy_dgxc.py          # per row, then per source/GPU/precision/split
    python bench/fit.py h100-fp8 gb200     # refit and write the H100 FP8 and GB200 fields (bench/fit.py)
    python bench/accuracy_dgxc.py --blackwell bridge   # another GB200 split: fit, score this bench and
                                           # bench/accuracy_holdout.py's dense rows, write nothing
                                           # (2026-11-24 before the TP overlap was priced, validate /
                                           # hold-out rows not fitted: both 5.6% / 12.0%, bridge 5.9% /
                                           # 11.4%, dgxc 6.1% / 18.1%; with it, both 5.7% / 12.0%)
    python bench/accuracy_dgxc.py --swap   # fit on the held-out NeMo models instead, score the fit ones
                                           # (2026-11-24: 6.4% MAPE, bias +0.2% on those 68 rows;
                                           # 6.6%, -0.8% before the TP overlap was priced)
    python bench/accuracy_dgxc.py --no-tp-overlap  # the NeMo rows' TP collectives without their overlap

TP communication overlap: every NeMo row with tp > 1 ran Transformer
Engine's userbuffers (bench/rows/dgxc/README.md), and is priced so: async TP
(planner.simulate.tp_overlap: each collective hidden under its own GEMM,
tp-chunked GEMMs at the knee's efficiency) with the SMs the recipe's
userbuffers config gives each overlapped collective taken from its GEMM
(sm_share_s; NeMo's tp_overlap_configs/userbuffers.py, TE's defaults where
NeMo has none). Measured 2026-11-24 on the 107 held-out rows: without the
overlap 5.6% MAPE (the profiles fitted that way); overlap without the SM
share 7.7% (too fast); with it and TE's default claims on every row 5.4%
before refitting; with each recipe's own claims 5.8% with the profiles
fitted without overlap, 5.7% after refitting with it (shipped; fit rows
5.9% -> 5.6%). --no-tp-overlap scores plain collectives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import rowset  # noqa: E402
from dgxc_rows import FAMILY, DgxcRow, load_dense_rows  # noqa: E402

from planner.simulate.calibration import CalibrationProfile, load_calibration  # noqa: E402
from topologies.hardware import get_gpu  # noqa: E402

FIT_MODELS = ("GPT-3 175B", "Llama 3.1 8B", "Llama 3.1 405B")
TARGET_MAPE = 0.12  # on rows not fitted (the goal beyond it: 5%)
TARGET_EXPRESSIBLE = 0.85
# (name, initial, lower, upper) per family; "attention_efficiency" follows gemm_efficiency (module doc)
FIT_PARAMETERS = {
    "h100": (("fp8_gemm_efficiency", 0.6, 0.2, 1.0),),
    "gb200": (("gemm_efficiency", 0.65, 0.3, 1.0), ("fp8_gemm_efficiency", 0.6, 0.2, 1.0)),
}


# GB200 fit rows (--blackwell): "dgxc" the DGX Cloud Llama 3.1 405B rows alone, attention tied to the
# GEMMs (one model cannot separate them); "bridge" the Megatron-Bridge GB200 rows alone (Llama 3 8B at
# 8K is attention-heavy, 70B/405B are not: the three efficiencies separate); "both" the two together.
# B200, B300 and GB300 share the GB200 profile (planner.simulate.calibration._DERIVED) and are never fitted.
BLACKWELL_SPLITS = ("dgxc", "bridge", "both")
BLACKWELL_GPUS = ("b200", "b300", "gb200", "gb300")
BLACKWELL_PARAMETERS = (("gemm_efficiency", 0.6, 0.3, 1.0), ("fp8_gemm_efficiency", 0.5, 0.2, 1.0),
                        ("attention_efficiency", 0.4, 0.05, 1.0))


def split(row: DgxcRow, swapped: bool = False) -> str:
    """fit | validate | inconsistent | inexpressible; swapped: the NeMo models' roles exchanged (--swap)."""
    if not row.expressible:
        return "inexpressible"
    if row.inconsistent:  # the row file's bench.inconsistent says why
        return "inconsistent"
    if row.source != "nemo":
        return "validate"
    return "fit" if (row.model.split(" proxy")[0] in FIT_MODELS) != swapped else "validate"


def profiles() -> dict[str, CalibrationProfile]:
    return {fam: load_calibration(None, get_gpu(gpu)) for gpu, fam in FAMILY.items()}


def simulate(row, profile: CalibrationProfile):
    """One row's step as `meshplan simulate ROW.json` predicts it, on `profile` (DGX Cloud rows and the
    Megatron-Bridge rows of the GB200 fit alike)."""
    return rowset.predict(row.row, profile)


def predict(row: DgxcRow, profile: CalibrationProfile) -> float:
    return simulate(row, profile).step_time_s


def error(row: DgxcRow, profs: dict[str, CalibrationProfile]) -> float:
    return predict(row, profs[FAMILY[row.gpu]]) / row.measured_s - 1.0


def summary(rows: list[DgxcRow], profs: dict[str, CalibrationProfile], show_rows: bool = True
            ) -> dict[tuple[str, str, str, str], tuple[float, float, int]]:
    """Print per row and per (source, gpu, precision, split); return {group: (MAPE, bias, rows)}."""
    errs: dict[str, float] = {}
    over: list[str] = []  # expressible rows whose predicted peak exceeds the GPU's memory
    for r in rows:
        if r.expressible:
            result = simulate(r, profs[FAMILY[r.gpu]])
            errs[r.id] = result.step_time_s / r.measured_s - 1.0
            if result.memory.peak_bytes > r.cluster().gpu.memory_bytes:
                over.append(r.id)
        if show_rows:
            shown = f"{100 * errs[r.id]:+6.1f}%" if r.expressible else f"  -     ({r.reason})"
            print(f"{r.id:<48} {split(r):<13} {r.measured_s:8.2f} s {shown}")
    groups: dict[tuple[str, str, str, str], list[DgxcRow]] = {}
    for r in rows:
        if split(r) in ("fit", "validate"):
            groups.setdefault((r.source, r.gpu, "fp8" if r.training.fp8 else "bf16", split(r)), []).append(r)
    out = {}
    for key, rs in sorted(groups.items()):
        e = [errs[r.id] for r in rs]
        worst = max(rs, key=lambda r: abs(errs[r.id]))
        out[key] = (sum(map(abs, e)) / len(e), sum(e) / len(e), len(e))
        print(f"{'/'.join(key):<30} {len(e):3} rows  MAPE {100 * out[key][0]:5.1f}%  bias {100 * out[key][1]:+5.1f}%  "
              f"worst {100 * errs[worst.id]:+5.1f}% ({worst.id})")
    for name in ("fit", "validate"):
        e = [errs[r.id] for r in rows if split(r) == name]
        print(f"ALL {name:<26} {len(e):3} rows  MAPE {100 * sum(map(abs, e)) / len(e):5.1f}%  "
              f"bias {100 * sum(e) / len(e):+5.1f}%")
    unfitted = [r for r in rows if split(r) != "fit"]
    expressible = sum(r.expressible for r in unfitted) / len(unfitted)
    left = sum(split(r) == "inconsistent" for r in rows)
    print(f"expressible: {100 * expressible:.1f}% of {len(unfitted)} rows not fitted (target >= "
          f"{100 * TARGET_EXPRESSIBLE:.0f}%); {left} inconsistent rows left out of fit and MAPE; "
          f"MAPE target <= {100 * TARGET_MAPE:.0f}% on rows not fitted")
    print(f"memory: {len(over)} of {len(errs)} expressible rows predicted above the GPU's memory (they ran): "
          f"{', '.join(sorted({i.rsplit('-', 2)[0] for i in over})) or 'none'}")
    return out


def validate_mape(rows: list[DgxcRow], profs: dict[str, CalibrationProfile]) -> tuple[float, float]:
    """(MAPE, bias) over every validate row."""
    e = [error(r, profs) for r in rows if split(r) == "validate"]
    return sum(map(abs, e)) / len(e), sum(e) / len(e)


def _apply(family: str, base: CalibrationProfile, values, params=None) -> CalibrationProfile:
    fields = {name: float(v) for (name, *_), v in zip(params or FIT_PARAMETERS[family], values, strict=True)}
    if "gemm_efficiency" in fields and "attention_efficiency" not in fields:
        h100 = load_calibration(None, get_gpu("h100-sxm"))
        fields["attention_efficiency"] = fields["gemm_efficiency"] * h100.attention_efficiency / h100.gemm_efficiency
    return base.replace(**fields)


def bridge_gb200_rows() -> list:
    """The Megatron-Bridge performance-summary GB200 dense rows bench/accuracy_holdout.py scores (expressible,
    consistent), priced as that bench prices them: with the TP overlap their scripts ran."""
    import accuracy_holdout

    rows = accuracy_holdout.load_rows()
    bad = accuracy_holdout.inconsistent(rows)
    return [r for r in rows if r.gpu == "gb200" and r.source == "megatron-bridge" and not r.moe
            and r.expressible and r.id not in bad]


def fit(rows: list[DgxcRow], swapped: bool = False, blackwell: str = "dgxc",
        only: tuple[str, ...] | None = None) -> dict[str, CalibrationProfile]:
    """Least squares on the relative errors of the fit rows, one family at a time.

    blackwell: which GB200 rows fit the GB200 profile (BLACKWELL_SPLITS);
    only: the families refitted (the others keep their shipped profiles).
    """
    import numpy as np
    from scipy.optimize import least_squares

    profs = profiles()
    for gpu, family in FAMILY.items():
        if only is not None and family not in only:
            continue
        mine = [r for r in rows if split(r, swapped) == "fit" and r.gpu == gpu]
        if family == "h100":
            mine = [r for r in mine if r.training.fp8]  # the bf16 parameters are not refitted here
        base, params = profs[family], FIT_PARAMETERS[family]
        if family == "gb200" and blackwell != "dgxc":
            params = BLACKWELL_PARAMETERS
            mine = (mine if blackwell == "both" else []) + bridge_gb200_rows()

        def residuals(values, mine=mine, base=base, family=family, params=params):
            prof = _apply(family, base, values, params)
            return np.array([predict(r, prof) / r.measured_s - 1.0 for r in mine])

        result = least_squares(residuals, [p[1] for p in params], bounds=([p[2] for p in params],
                               [p[3] for p in params]), diff_step=1e-3, loss="soft_l1", f_scale=0.1)
        profs[family] = _apply(family, base, [float(f"{v:.4g}") for v in result.x], params)
    return profs


def score_holdout(gb200: CalibrationProfile) -> dict:
    """bench/accuracy_holdout.py's dense per-GPU lines with this GB200 profile on every Blackwell part."""
    import accuracy_holdout

    fields = {k: getattr(gb200, k) for k in ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency")}
    overrides = accuracy_holdout.carried(fields, "gb200", BLACKWELL_GPUS)  # per SM, as the shipped profile
    rows = [r for r in accuracy_holdout.load_rows() if not r.moe]
    figures = accuracy_holdout.summary(rows, show_rows=False, overrides=overrides)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="only the per-group lines")
    parser.add_argument("--swap", action="store_true",
                        help="robustness: fit on the held-out NeMo models, score the usual fit models (writes nothing)")
    parser.add_argument("--blackwell", choices=BLACKWELL_SPLITS,
                        help="fit the GB200 profile on these rows, print this bench and bench/accuracy_holdout.py's "
                             "dense figures with it (a what-if: writes nothing; bench/fit.py gb200 fits on both)")
    parser.add_argument("--no-tp-overlap", action="store_true",
                        help="price the NeMo rows' TP collectives as plain ones, not the overlap they ran; see the module doc")
    args = parser.parse_args()
    rows = load_dense_rows(tp_overlap=not args.no_tp_overlap)
    if args.swap:
        profs = fit(rows, swapped=True)
        e = [error(r, profs) for r in rows if split(r, swapped=True) == "validate" and r.source == "nemo"]
        print(f"swapped split: fitted on {', '.join(sorted({r.model for r in rows if split(r, True) == 'fit'}))}; "
              f"{len(e)} NeMo rows of {', '.join(FIT_MODELS)} scored: MAPE {100 * sum(map(abs, e)) / len(e):.1f}%, "
              f"bias {100 * sum(e) / len(e):+.1f}%")
        return
    blackwell = args.blackwell or "both"
    profs = fit(rows, blackwell=blackwell) if args.blackwell is not None else profiles()
    for fam, p in profs.items():
        print(f"{fam}: gemm {p.gemm_efficiency}, fp8 gemm {p.fp8_gemm_efficiency}, attention "
              f"{p.attention_efficiency} ({p.source}, {p.date})")
    summary(rows, profs, show_rows=not args.quiet)
    if args.blackwell is not None:
        print(f"--- bench/accuracy_holdout.py dense rows, GB200 profile fitted with --blackwell {blackwell}")
        score_holdout(profs["gb200"])


if __name__ == "__main__":
    main()
