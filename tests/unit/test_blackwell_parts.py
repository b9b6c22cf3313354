"""The Blackwell family's evidence bench (bench/blackwell_parts.py): same-recipe pairs and the Ultra residual."""

from __future__ import annotations

import pytest
from conftest import load_bench

bench = load_bench("blackwell_parts")


@pytest.fixture(scope="module")
def rows():
    return bench.holdout.load_rows()


def test_the_runs_follow_the_sms_not_the_rated_peaks(rows):
    pairs = bench.same_recipe_pairs(rows)
    same_die = [(a, b) for a, b in pairs if (a.gpu, b.gpu) == ("b200", "gb200") and "8b" in a.model]
    assert len(same_die) == 4  # Llama 3 8B FP8 and MXFP8, 25.09 and 25.11: one recipe, one layout
    for b200, gb200 in same_die:
        measured = b200.measured_s / gb200.measured_s  # step-time ratio: tokens/s of GB200 over B200's
        assert 1.0 < measured < 1.05 < gb200.cluster().gpu.bf16_flops / b200.cluster().gpu.bf16_flops
        predicted = bench.holdout.simulate(b200).step_time_s / bench.holdout.simulate(gb200).step_time_s
        assert predicted == pytest.approx(1.0, abs=0.01)  # the same 148 SMs at the same sustained rate
    ultra = [(a, b) for a, b in pairs if (a.gpu, b.gpu) == ("gb200", "gb300")]
    assert len(ultra) >= 4
    equal_rate = bench.ultra_overrides(1.0)

    def lead(overrides):  # measured GB300-over-GB200 speed-up over the predicted one, median of the pairs
        ratios = sorted(a.measured_s / b.measured_s / (bench.holdout.simulate(a, overrides).step_time_s
                                                       / bench.holdout.simulate(b, overrides).step_time_s)
                        for a, b in ultra)
        return ratios[len(ratios) // 2]

    # Blackwell Ultra runs faster than its 160 SMs and doubled SFU rate explain; the shipped factor covers it
    assert lead(equal_rate) > 1.05 and abs(lead(None) - 1.0) < 0.04


def test_an_ultra_factor_fitted_on_one_release_is_scored_on_the_other(rows):
    ultra = [r for r in rows if r.gpu == "gb300" and r.expressible and not r.moe]
    fit_on = [r for r in ultra if r.release == "25.11"]
    held = [r for r in ultra if r.release == "26.02"]
    factor = bench.fit_ultra(fit_on)
    assert 1.05 < factor < 1.2
    before, after = bench.scores(held, 1.0), bench.scores(held, factor)
    assert sum(map(abs, after.values())) < 0.5 * sum(map(abs, before.values()))


def test_the_shipped_ultra_factor_is_what_its_fit_produces(rows):
    from planner.simulate.calibration import default_calibration
    from topologies.hardware import get_gpu

    shipped = default_calibration(get_gpu("gb200")).part_sm_rate
    assert set(shipped) == set(bench.ULTRA) and len(set(shipped.values())) == 1
    assert bench.fit_ultra(bench.fit_rows(rows)) == pytest.approx(shipped["gb300"], abs=0.006)
    assert {r.release for r in bench.fit_rows(rows)} == {"25.11"} and all(bench.holdout.fitted(r) for r in bench.fit_rows(rows))
