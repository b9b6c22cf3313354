"""The uncertainty band beside each prediction comes from the accuracy benches, and plan.json carries it."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, load_bench, shared_data

from planner.accuracy.bands import BANDS_PATH, band_for, load_bands
from planner.cli.plan import search_plan
from planner.search.candidates import Pins


@pytest.fixture(scope="module")
def recomputed():
    """The bands as the bench computes them now (every accuracy bench's scoring, nothing fitted)."""
    shared_data("data/vtrain/ground_truth_single.csv")
    bench = load_bench("uncertainty_bands")
    return {(b["engine"], b["gpu_family"], b["moe"]): b for b in bench.bands(bench.collect())}


def test_bands_json_is_the_benchs_output(recomputed):
    """Loosely: the shipped table holds the groups the benches measure now, each within 2 points of them
    (a change to the simulator that moves a group more must rerun bench/uncertainty_bands.py)."""
    doc = json.loads(BANDS_PATH.read_text())
    assert doc["written_by"] == "bench/uncertainty_bands.py"
    shipped = {(b["engine"], b["gpu_family"], b["moe"]): b for b in doc["bands"]}
    assert set(shipped) == set(recomputed)
    for key, band in shipped.items():
        now = recomputed[key]
        assert band["rows"] == now["rows"], key
        assert band["p90_abs_error"] == pytest.approx(now["p90_abs_error"], abs=0.02), key
        assert band["mape"] == pytest.approx(now["mape"], abs=0.01), key
        for name in band["benches"]:
            assert (REPO / "bench" / name.split(" ")[0]).is_file(), name


def test_bands_agree_with_the_accuracy_targets():
    """The groups the accuracy tests hold to a MAPE target are within it here too."""
    targets = {("megatron", "h100", False): load_bench("accuracy_dgxc").TARGET_MAPE,
               ("meshplan", "h100", False): load_bench("accuracy_published").TARGET_MAPE,
               ("megatron", "a100", False): load_bench("accuracy_megatron_papers").TARGET,
               ("megatron", "gb200", False): load_bench("accuracy_holdout").TARGET_MAPE}
    by_key = {(b.engine, b.gpu_family, b.moe): b for b in load_bands()}
    for key, target in targets.items():
        assert by_key[key].mape <= target, key
        assert by_key[key].p90_abs_error >= by_key[key].mape  # a 90th percentile is never below the mean


def test_plan_json_carries_the_band_or_says_not_validated():
    h100, _ = search_plan("llama3-8b", "dgx-h100", 8, (), None, None, Pins(), "meshplan", None, 1)
    u = h100.prediction.to_json()["uncertainty"]
    band = band_for("meshplan", "h100-sxm", False)
    assert u["validated"] and u["band"] == band.p90_abs_error and u["rows"] == band.rows
    assert any(f"±{100 * band.p90_abs_error:.2g}%" in s for s in h100.explanation)
    amd, _ = search_plan("llama3-8b", "mi300x", 8, (), None, None, Pins(), "meshplan", None, 1)
    u = amd.prediction.to_json()["uncertainty"]
    assert not u["validated"] and "no bench measures engine meshplan on mi300x" in u["reason"]
    assert any("not validated" in s for s in amd.explanation)
    moe, _ = search_plan("qwen3-30b-a3b", "dgx-h100", 16, (), 4096, None, Pins(), "megatron", None, 1)
    assert moe.prediction.to_json()["uncertainty"]["band"] == band_for("megatron", "h100", True).p90_abs_error
