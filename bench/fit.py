"""The one command that writes fitted numbers: every calibration profile field fitted on published runs, and the
one fitted cluster figure, each with the rows it was fitted on, the fit's error, the held-out rows' error and
the date.

    python bench/fit.py                  # every fit, in order, writing the shipped files
    python bench/fit.py h100-fp8 moe     # those fits only (each starts from what the files hold now)
    python bench/fit.py --out DIR        # write copies under DIR instead (the shipped files untouched)

Fits run in the order below; each starts from the profiles the earlier ones wrote and replaces only its own
fields (a fit never rebuilds a profile from defaults, so no fit resets another's numbers). Every fit is scored
on rows it never saw (other models, releases or parts, named in the record). A profile's `fits` holds, per fit:
`fields` (each fitted field by path, e.g. engine_factors.meshplan.attention_efficiency, and its value),
`rows` (the row ids fitted on, by bench/rows folder), `error` and `held_out` (MAPE, bias, row count and worst
rows), `date`, `command`. Predictions are `meshplan simulate ROW.json`'s (bench/rowset.py), fits least
squares on relative step-time errors, few parameters with a physical meaning, never one per row or source.

  a100             vTrain's Megatron-DeepSpeed A100 steps -> a100.json: GEMM efficiency and knee, memory-bound
                   efficiency, host time and its overlap, collective latency, NVLink and network efficiency
                   (held out: the Megatron-LM papers' A100 runs)
  h100-bf16        NeMo 24.09 and LLM Foundry bf16 runs of 7 models -> h100.json: GEMM and fused-attention
                   efficiency, the eager engines' attention and memory-bound factors (held out: 5 other models,
                   the DGX Cloud H100 bf16 runs)
  h100-fp8         DGX Cloud NeMo FP8 runs of GPT-3 175B, Llama 3.1 8B/405B -> h100.json fp8_gemm_efficiency
                   (held out: the other DGX Cloud FP8 models, Megatron-Bridge H100 FP8)
  gb200            DGX Cloud Llama 3.1 405B GB200 and Megatron-Bridge GB200 dense runs -> gb200.json: GEMM,
                   FP8 GEMM and attention efficiency (held out: other DGX Cloud GB200 models, B200)
  blackwell-ultra  Megatron-Bridge 25.11 GB300 dense runs -> gb200.json part_sm_rate (held out: 26.02 GB300, B300)
  moe              DGX Cloud MoE runs (Grok-1, DeepSeek-V3) -> h100.json and gb200.json: grouped GEMM, network
                   all-to-all, FP8 expert efficiencies (held out: Megatron-Bridge MoE runs)
  grand-teton      torchtitan's table 1 eager FSDP row -> bench/clusters/grand-teton-h100.toml: the 500 W cap's
                   share of the tensor-core rate (held out: the table's 17 other rows); record beside it in
                   grand-teton-h100.fit.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import rowset  # noqa: E402

from planner.cli import row as row_module  # noqa: E402
from planner.cli.row import Row  # noqa: E402
from planner.simulate import calibration as calibration_module  # noqa: E402
from planner.simulate.calibration import CalibrationProfile  # noqa: E402
from planner.simulate.fit_records import field_value, with_field  # noqa: E402

CLUSTER = REPO / "bench" / "clusters" / "grand-teton-h100.toml"
WORST = 3  # worst rows kept in a record


# ---- what a fit is --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fit:
    """One fit: the rows it sees, the rows it is scored on, and how it finds its fields' values."""

    name: str
    targets: tuple[str, ...]  # profile families it writes (a100, h100, gb200), or "cluster"
    summary: str  # what it fits on what, for the profile's `source`
    fit_rows: Callable[[], list[Row]]
    held_out: Callable[[], list[Row]]
    solve: Callable[[list[Row]], dict[str, dict[str, float]]]  # {target: {field path: value}}


def _bench(name: str):
    import importlib

    return importlib.import_module(name)


def _usable(rows) -> list[Row]:
    """The row files of bench row views (or rows), expressible."""
    out = [getattr(r, "row", r) for r in rows]
    return [r for r in out if r.expressible]


def _fields(profile: CalibrationProfile, paths: tuple[str, ...]) -> dict[str, float]:
    return {p: field_value(profile, p) for p in paths}


# a100 ------------------------------------------------------------------------------------------------------

def _a100_rows() -> list[Row]:
    return rowset.rows("vtrain")


def _a100_solve(rows: list[Row]) -> dict[str, dict[str, float]]:
    vtrain = _bench("accuracy_vtrain")
    by_kind = {kind: [r for r in rows if r.bench["file"] == kind] for kind in vtrain.FILES}
    fitted = vtrain.fit(by_kind, profile_file("a100"))
    names = tuple(n if n not in ("nvlink", "net") else f"link_efficiency.{n}" for n, *_ in vtrain.FIT_PARAMETERS)
    return {"a100": _fields(fitted, names)}


# h100 ------------------------------------------------------------------------------------------------------

def _published_rows(split: str) -> list[Row]:
    return _usable(r for r in _bench("accuracy_published").load_rows() if r.split == split)


def _dgxc_rows(gpu: str, fp8: bool, split: str) -> list[Row]:
    dgxc = _bench("accuracy_dgxc")
    return _usable(r for r in _bench("dgxc_rows").load_dense_rows()
                   if r.gpu == gpu and dgxc.split(r) == split and r.training.fp8 == fp8)


def _bridge_rows(gpus: tuple[str, ...], moe: bool, release: str | None = None) -> list[Row]:
    holdout = _bench("accuracy_holdout")
    rows = holdout.load_rows()
    bad = holdout.inconsistent(rows)
    return _usable(r for r in rows if r.gpu in gpus and r.moe == moe and r.expressible and r.id not in bad
                   and r.source == "megatron-bridge" and release in (None, r.release))


def _h100_bf16_solve(rows: list[Row]) -> dict[str, dict[str, float]]:
    published = _bench("accuracy_published")
    views = [r for r in published.load_rows() if r.row.path in {x.path for x in rows}]
    fitted = published.fit(views, profile_file("h100"))
    paths = ("gemm_efficiency", "attention_efficiency") + tuple(
        f"engine_factors.{engine}.{key}" for engine, factors in fitted.engine_factors.items() for key in factors)
    return {"h100": _fields(fitted, paths)}


def _dgxc_solve(family: str, blackwell: str = "both") -> Callable[[list[Row]], dict[str, dict[str, float]]]:
    def solve(rows: list[Row]) -> dict[str, dict[str, float]]:
        dgxc = _bench("accuracy_dgxc")
        profs = dgxc.fit(_bench("dgxc_rows").load_dense_rows(), blackwell=blackwell, only=(family,))
        names = [n for n, *_ in (dgxc.BLACKWELL_PARAMETERS if family == "gb200" else dgxc.FIT_PARAMETERS[family])]
        return {family: _fields(profs[family], tuple(names))}
    return solve


def _dgxc_fit_rows(family: str) -> Callable[[], list[Row]]:
    def rows() -> list[Row]:
        if family == "h100":
            return _dgxc_rows("h100-sxm", True, "fit")
        dgxc = _bench("accuracy_dgxc")
        return _dgxc_rows("gb200", True, "fit") + _dgxc_rows("gb200", False, "fit") + _usable(dgxc.bridge_gb200_rows())
    return rows


# Blackwell Ultra and MoE -----------------------------------------------------------------------------------

def _ultra_solve(rows: list[Row]) -> dict[str, dict[str, float]]:
    parts = _bench("blackwell_parts")
    ids = {r.id for r in rows}
    factor = parts.fit_ultra([r for r in parts.holdout.load_rows() if r.id in ids])
    return {"gb200": {f"part_sm_rate.{g}": factor for g in parts.ULTRA}}


def _moe_fit_rows() -> list[Row]:
    moe = _bench("accuracy_moe")
    return [r.row for r in moe.scored(moe.load_rows()) if not moe.fit_excluded(r)]


def _moe_solve(rows: list[Row]) -> dict[str, dict[str, float]]:
    moe = _bench("accuracy_moe")
    ids = {r.id for r in rows}
    values = moe.fit([r for r in moe.load_rows() if r.id in ids], moe.base_profiles())
    return {family: {key.partition("@")[0]: v for key, v in values.items() if key.partition("@")[2] in ("", family)}
            for family in ("h100", "gb200")}


# grand-teton -----------------------------------------------------------------------------------------------

def _titan_rows(fitted: bool) -> list[Row]:
    titan = _bench("accuracy_torchtitan_h100")
    return [r for r in titan.ROWS if (r.id == titan.FIT_ROW) == fitted]


def _titan_solve(rows: list[Row]) -> dict[str, dict[str, float]]:
    (row,) = rows
    return {"cluster": {"power_cap_flops_fraction": round(_bench("accuracy_torchtitan_h100").fit_fraction(row), 3)}}


FITS: tuple[Fit, ...] = (
    Fit("a100", ("a100",), "GEMM efficiency and knee, memory-bound efficiency, host time and its overlap exponent, "
        "collective latency, NVLink and network efficiency fitted on vTrain's Megatron-DeepSpeed A100 measurements",
        _a100_rows, lambda: _usable(_bench("accuracy_megatron_papers").load_rows()), _a100_solve),
    Fit("h100-bf16", ("h100",), "GEMM and fused-attention efficiencies and the eager engines' attention and "
        "memory-bound factors fitted on published NeMo 24.09 (Megatron-Core) and LLM Foundry (PyTorch FSDP) H100 "
        "bf16 runs of 7 models",
        lambda: _published_rows("fit"),
        lambda: _published_rows("validate") + _dgxc_rows("h100-sxm", False, "fit")
        + _dgxc_rows("h100-sxm", False, "validate"), _h100_bf16_solve),
    Fit("h100-fp8", ("h100",), "fp8_gemm_efficiency fitted on DGX Cloud NeMo FP8 runs of GPT-3 175B, Llama 3.1 "
        "8B/405B", _dgxc_fit_rows("h100"),
        lambda: _dgxc_rows("h100-sxm", True, "validate") + [r for r in _bridge_rows(("h100",), False)
                                                            if "fp8" in r.bench["precision"]], _dgxc_solve("h100")),
    Fit("gb200", ("gb200",), "GEMM, FP8 GEMM and attention efficiencies fitted on DGX Cloud NeMo Llama 3.1 405B "
        "GB200 NVL72 runs and the Megatron-Bridge GB200 dense runs (Llama 3 8B/70B, Llama 3.1 405B; bf16, FP8, "
        "MXFP8)", _dgxc_fit_rows("gb200"),
        lambda: _dgxc_rows("gb200", False, "validate") + _dgxc_rows("gb200", True, "validate")
        + _bridge_rows(("b200",), False), _dgxc_solve("gb200")),
    Fit("blackwell-ultra", ("gb200",), "part_sm_rate (Blackwell Ultra's sustained FLOP/s per SM over Blackwell's, "
        "B300 and GB300) fitted on the Megatron-Bridge 25.11 GB300 dense runs",
        lambda: _bridge_rows(("gb300",), False, "25.11"),
        lambda: _bridge_rows(("gb300",), False, "26.02") + _bridge_rows(("b300",), False), _ultra_solve),
    Fit("moe", ("h100", "gb200"), "grouped_gemm_efficiency, all_to_all_net_efficiency and fp8_expert_efficiency "
        "fitted on the DGX Cloud MoE runs (Grok-1, DeepSeek-V3; H100, GB200; DeepSeek-V3 on GB200, host-bound, "
        "left out)", _moe_fit_rows,
        lambda: _bridge_rows(("h100", "b200", "b300", "gb200", "gb300"), True), _moe_solve),
    Fit("grand-teton", ("cluster",), "the 500 W cap's share of the H100 SXM tensor-core rate, fitted on torchtitan's "
        "table 1 eager FSDP row", lambda: _titan_rows(True), lambda: _titan_rows(False), _titan_solve),
)
# What a profile says beside its fits: numbers derived, not fitted
NOTES = {
    "a100": "layer_overhead_s is the host time of the reference dense layer with fused attention "
            "(planner.simulate.launches): vTrain's layers ran unfused attention, 23 host operations per forward "
            "against 16",
    "h100": "",
    "gb200": "layer_overhead_s is the H100 profile's 0.5 ms times 2.75, the host time of one PyTorch Linear forward "
             "on GB200's Grace CPU over a DGX H100's Xeon 8480C (37.1 vs 13.5 us, TransformerEngine issue #2053); "
             "B200, B300 and GB300 take this profile per SM (planner.simulate.calibration.per_sm_transfer)",
}


# ---- files ----------------------------------------------------------------------------------------------------

def profile_file(family: str) -> CalibrationProfile:
    """The profile file as written (no per-SM transfer, no lent factors, other_bytes as stored)."""
    return CalibrationProfile.from_json(json.loads((calibration_module.CALIBRATION_DIR / f"{family}.json").read_text()))


def _refresh() -> None:
    """Forget every profile and row plan read so far: the next prediction reads the files as they are now."""
    from topologies import cluster_load

    calibration_module.default_calibration.cache_clear()
    cluster_load._read_toml.cache_clear()
    row_module.forget_plans()


def write_profile(family: str, fit: Fit, values: dict[str, float], record: dict[str, Any], today: str) -> None:
    profile = profile_file(family)
    for path, value in values.items():
        profile = with_field(profile, path, value)
    fits = {**profile.fits, fit.name: record}
    fits = {f.name: fits[f.name] for f in FITS if f.name in fits} | {k: v for k, v in fits.items()
                                                                     if k not in {f.name for f in FITS}}
    summaries = [f"{f.summary} (bench/fit.py {f.name}, {fits[f.name]['date']})" for f in FITS if f.name in fits]
    source = "; ".join(summaries + ([NOTES[family]] if NOTES.get(family) else []))
    profile.replace(fits=fits, source=source, date=today).save(calibration_module.CALIBRATION_DIR / f"{family}.json")


def write_cluster(path: Path, fraction: float, record: dict[str, Any]) -> None:
    """The cluster file's two tensor-core rates at `fraction` of the H100 SXM's, and the record beside it."""
    from topologies.hardware import get_gpu

    h100 = get_gpu("h100-sxm")
    text = CLUSTER.read_text()
    bf16, fp8 = h100.bf16_flops / 1e12, h100.fp8_flops / 1e12
    text = re.sub(r"(?m)^gpu_bf16_tflops = .*$", f"gpu_bf16_tflops = {bf16 * fraction:.4f}  # {bf16:g} x {fraction}",
                  text)
    text = re.sub(r"(?m)^gpu_fp8_tflops = .*$", f"gpu_fp8_tflops = {fp8 * fraction:.4f}  # {fp8:g} x {fraction}", text)
    text = re.sub(r"dense TFLOP/s times [0-9.]+", f"dense TFLOP/s times {fraction}", text)
    path.write_text(text)
    path.with_suffix(".fit.json").write_text(json.dumps(record, indent=1) + "\n")


# ---- scoring ---------------------------------------------------------------------------------------------------

def errors(rows: list[Row], extra: tuple[str, ...] = ()) -> dict[str, float]:
    """{row id: predicted / measured step time - 1} with the files as they are now (`extra` flags: the cluster
    file written under --out)."""
    return {r.id: rowset.predict(r, extra=extra).step_time_s / r.measured_s - 1.0 for r in rows}


def score(errs: dict[str, float]) -> dict[str, Any]:
    values = list(errs.values())
    worst = sorted(errs, key=lambda k: -abs(errs[k]))[:WORST]
    return {"n": len(values), "mape": round(sum(map(abs, values)) / len(values), 4),
            "bias": round(sum(values) / len(values), 4), "worst": {k: round(errs[k], 4) for k in worst}}


def by_folder(rows: list[Row]) -> dict[str, Any]:
    """Row ids by bench/rows folder; a whole folder as "all N rows"."""
    out: dict[str, Any] = {}
    for r in rows:
        out.setdefault(r.path.parent.name, []).append(r.id)
    for folder, ids in out.items():
        if len(ids) == len(rowset.rows(folder)) and len(ids) > 50:
            out[folder] = f"all {len(ids)} rows"
    return out


def _line(label: str, s: dict[str, Any]) -> str:
    return f"{label:<10} {s['n']:5} rows  MAPE {100 * s['mape']:5.2f}%  bias {100 * s['bias']:+6.2f}%"


def run(fit: Fit, cluster_path: Path, today: str) -> dict[str, Any]:
    """Fit, write, and print before/after on the fit rows and the held-out rows; the record written."""
    _refresh()
    fit_rows, held = fit.fit_rows(), fit.held_out()
    extra = ("--cluster", str(cluster_path)) if "cluster" in fit.targets and cluster_path != CLUSTER else ()
    before = {"fit": score(errors(fit_rows, extra)), "held out": score(errors(held, extra))}
    solved = fit.solve(fit_rows)
    old = {t: ({p: field_value(profile_file(t), p) for p in v} if t != "cluster" else
               {p: _bench("accuracy_torchtitan_h100").POWER_CAP_FLOPS_FRACTION for p in v})
           for t, v in solved.items()}
    record = {"fields": {}, "rows": by_folder(fit_rows), "held_out_rows": by_folder(held), "date": today,
              "command": f"python bench/fit.py {fit.name}"}
    for target, values in solved.items():
        record["fields"] = values
        if target == "cluster":
            write_cluster(cluster_path, values["power_cap_flops_fraction"], record)
        else:
            write_profile(target, fit, values, record, today)
    _refresh()
    after = {"fit": score(errors(fit_rows, extra)), "held out": score(errors(held, extra))}
    print(f"== {fit.name}: {fit.summary}")
    for target, values in solved.items():
        for path, value in values.items():
            print(f"   {target} {path}: {old[target][path]} -> {value}")
    for split in ("fit", "held out"):
        print(f"   {_line(split, before[split])}  ->  MAPE {100 * after[split]['mape']:5.2f}%  "
              f"bias {100 * after[split]['bias']:+6.2f}%   worst: "
              + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in after[split]["worst"].items()))
    # records carry the figures after the fit
    record = {"fields": {}, "rows": record["rows"], "error": after["fit"], "held_out_rows": record["held_out_rows"],
              "held_out": after["held out"], "date": today, "command": record["command"]}
    for target, values in solved.items():
        record["fields"] = values
        if target == "cluster":
            cluster_path.with_suffix(".fit.json").write_text(json.dumps(record, indent=1) + "\n")
        else:
            write_profile(target, fit, values, record, today)
    return record


def main(argv: list[str] | None = None) -> None:
    names = [f.name for f in FITS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fits", nargs="*", metavar="FIT", help=f"fits to run, in their order ({', '.join(names)}; "
                                                               "default: all)")
    parser.add_argument("--out", type=Path, help="write copies of the profiles and the cluster file under this "
                                                 "folder, leave the shipped ones as they are")
    args = parser.parse_args(argv)
    unknown = [n for n in args.fits if n not in names]
    if unknown:
        parser.error(f"unknown fit {unknown[0]!r}; fits are {', '.join(names)}")
    chosen = [f for f in FITS if not args.fits or f.name in args.fits]
    cluster_path, shipped = CLUSTER, calibration_module.CALIBRATION_DIR
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for family in ("a100", "h100", "gb200"):
            shutil.copy(shipped / f"{family}.json", args.out / f"{family}.json")
        shutil.copy(CLUSTER, args.out / CLUSTER.name)
        cluster_path = args.out / CLUSTER.name
        calibration_module.CALIBRATION_DIR = args.out
    today = datetime.date.today().isoformat()
    try:
        for fit in chosen:
            run(fit, cluster_path, today)
    finally:
        calibration_module.CALIBRATION_DIR = shipped
        _refresh()


if __name__ == "__main__":
    main()
