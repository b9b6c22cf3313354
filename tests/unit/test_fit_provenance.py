"""Fits with provenance: every fitted number in a shipped profile (and the Grand Teton cluster file) names the fit
that wrote it, the rows it was fitted on, its error, the held-out rows' error and the date (bench/fit.py)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import load_bench

from planner.simulate import calibration as calibration_module
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.fit_records import field_value, with_field
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError
from topologies.hardware import get_gpu

fit = load_bench("fit")
rowset = load_bench("rowset")
FAMILIES = ("a100", "h100", "gb200")
ISO_DATE = re.compile(r"\d{4}-\d\d-\d\d")


def _profile(family: str) -> CalibrationProfile:
    return CalibrationProfile.from_json(json.loads((calibration_module.CALIBRATION_DIR / f"{family}.json").read_text()))


def _row_ids(folder: str) -> set[str]:
    return {r.id for r in rowset.rows(folder)}


def _check_record(name: str, record: dict) -> None:
    assert ISO_DATE.fullmatch(record["date"]) and record["command"] == f"python bench/fit.py {name}"
    for key in ("rows", "held_out_rows"):
        assert record[key], (name, key)
        for folder, ids in record[key].items():
            known = _row_ids(folder)
            if isinstance(ids, str):  # a whole folder
                assert ids == f"all {len(known)} rows"
            else:
                assert set(ids) <= known and len(set(ids)) == len(ids), (name, folder)
    fitted = {(f, i) for f, ids in record["rows"].items() if not isinstance(ids, str) for i in ids}
    held = {(f, i) for f, ids in record["held_out_rows"].items() if not isinstance(ids, str) for i in ids}
    assert not fitted & held, name  # held-out rows are rows the fit never saw
    for key in ("error", "held_out"):
        s = record[key]
        assert s["n"] > 0 and 0 <= s["mape"] < 1 and abs(s["bias"]) <= s["mape"] + 1e-9 and s["worst"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_fitted_field_records_its_fit(family):
    profile = _profile(family)
    written = [f for f in fit.FITS if family in f.targets]
    assert set(profile.fits) == {f.name for f in written}
    for name, record in profile.fits.items():
        _check_record(name, record)
        for path, value in record["fields"].items():
            assert field_value(profile, path) == pytest.approx(value, rel=1e-12), (family, name, path)
        assert f"bench/fit.py {name}, {record['date']}" in profile.source


def test_the_cluster_files_fraction_records_its_fit():
    record = json.loads(fit.CLUSTER.with_suffix(".fit.json").read_text())
    _check_record("grand-teton", record)
    fraction = record["fields"]["power_cap_flops_fraction"]
    gpu = load_cluster(str(fit.CLUSTER), 8).gpu
    h100 = get_gpu("h100-sxm")
    assert gpu.bf16_flops == pytest.approx(h100.bf16_flops * fraction, rel=1e-6)
    assert gpu.fp8_flops == pytest.approx(h100.fp8_flops * fraction, rel=1e-6)


def test_saving_drops_a_record_its_profile_no_longer_holds(tmp_path):
    record = {"fields": {"gemm_efficiency": 0.7, "engine_factors.meshplan.attention_efficiency": 0.6},
              "rows": {"published": ["x"]}, "date": "2026-01-01"}
    profile = CalibrationProfile(gpu="h100-sxm", gemm_efficiency=0.7, engine_factors={"meshplan": {
        "attention_efficiency": 0.6}}, fits={"f": record})
    profile.save(tmp_path / "kept.json")
    assert json.loads((tmp_path / "kept.json").read_text())["fits"] == {"f": record}
    with_field(profile, "engine_factors.meshplan.attention_efficiency", 0.5).save(tmp_path / "dropped.json")
    assert json.loads((tmp_path / "dropped.json").read_text())["fits"] == {}


@pytest.mark.parametrize("fits", [[], {"f": {"fields": {}}}, {"f": {"fields": {"no_such_field": 1}, "rows": {},
                                                                         "date": ""}}])
def test_malformed_fit_records_are_refused(fits):
    with pytest.raises(UsageError, match="fits"):
        CalibrationProfile(fits=fits)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The shipped profiles copied to tmp_path, read from there."""
    for family in FAMILIES:
        shutil.copy(calibration_module.CALIBRATION_DIR / f"{family}.json", tmp_path)
    monkeypatch.setattr(calibration_module, "CALIBRATION_DIR", tmp_path)
    yield tmp_path
    calibration_module.default_calibration.cache_clear()


def test_a_fit_writes_only_its_own_fields(scratch):
    """h100-bf16 used to rebuild h100.json from defaults, resetting the FP8 and MoE fields other fits wrote."""
    before = _profile("h100")
    h100_bf16 = next(f for f in fit.FITS if f.name == "h100-bf16")
    record = {**before.fits["h100-bf16"], "fields": {"gemm_efficiency": 0.5}, "date": "2026-01-02"}
    fit.write_profile("h100", h100_bf16, {"gemm_efficiency": 0.5}, record, "2026-01-02")
    after = _profile("h100")
    assert after.gemm_efficiency == 0.5
    for key in ("fp8_gemm_efficiency", "grouped_gemm_efficiency", "all_to_all_net_efficiency", "fp8_expert_efficiency",
                "attention_efficiency", "engine_factors"):
        assert getattr(after, key) == getattr(before, key), key
    assert after.fits["h100-bf16"]["fields"] == {"gemm_efficiency": 0.5}
    assert {k: v for k, v in after.fits.items() if k != "h100-bf16"} == \
        {k: v for k, v in before.fits.items() if k != "h100-bf16"}
    assert after.date == "2026-01-02" and "bench/fit.py h100-bf16, 2026-01-02" in after.source


def test_fit_command_under_out_leaves_the_shipped_files(tmp_path):
    shipped = {p: p.read_bytes() for p in [*calibration_module.CALIBRATION_DIR.glob("*.json"), fit.CLUSTER,
                                           fit.CLUSTER.with_suffix(".fit.json")]}
    fit.main(["grand-teton", "--out", str(tmp_path)])
    assert {p: p.read_bytes() for p in shipped} == shipped
    assert calibration_module.CALIBRATION_DIR == next(iter(shipped)).parent  # restored
    record = json.loads((tmp_path / "grand-teton-h100.fit.json").read_text())
    _check_record("grand-teton", record)
    shipped_record = json.loads(fit.CLUSTER.with_suffix(".fit.json").read_text())
    assert record["fields"] == shipped_record["fields"]  # the fit is deterministic: the shipped value again


def test_unknown_fit_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        fit.main(["h100"])
    assert exc.value.code == 2
    assert "unknown fit 'h100'; fits are a100, h100-bf16" in capsys.readouterr().err
