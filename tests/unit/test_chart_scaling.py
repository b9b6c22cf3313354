"""`plan --gpus auto --png`: the scaling chart of a 70B sweep, checked from the sweep behind it and the figure."""

from __future__ import annotations

import pytest

from planner.charts.scaling import ScalingChart, ScalingPoint, draw_scaling_chart, scaling_chart
from planner.cli.request import PlanRequest
from planner.cli.sweep import sweep_request
from planner.search.candidates import Pins
from planner.search.search import USABLE_MEMORY_FRACTION
from planner.search.sweep import SCALING_WORTH_IT, parse_gpus

TOKENS, PRICE = 2e12, 2.5


@pytest.fixture(scope="module")
def sweep_70b():
    request = PlanRequest("70B", "dgx-h100", (), None, None, Pins(), "meshplan", None, 5, USABLE_MEMORY_FRACTION)
    found, _ = sweep_request(request, parse_gpus("auto"), quiet=True)
    return found, scaling_chart(found, "70B", TOKENS, PRICE)


def _line(ax, label: str):
    return next(line for line in ax.lines if line.get_label() == label)


def test_70b_chart_holds_the_sweep(sweep_70b):
    found, chart = sweep_70b
    fits = [p for p in found.points if p.fits]
    assert [p.gpus for p in chart.fitting] == [p.gpus for p in fits] and len(fits) >= 3
    for point, p in zip(chart.fitting, fits, strict=True):
        assert point.tokens_per_s == p.tokens_per_s
        assert point.days == pytest.approx(TOKENS / p.tokens_per_s / 86400)
        assert point.cost == pytest.approx(TOKENS / p.tokens_per_s / 3600 * p.gpus * PRICE)
    best = max(fits, key=lambda p: p.tokens_per_s_per_gpu)
    assert chart.recommended_gpus == best.gpus == found.recommended.gpus == found.to_json()["recommended_gpus"]
    assert chart.recommended.cost == min(p.cost for p in chart.fitting)  # most tokens/s per GPU = cheapest
    assert chart.smallest_fit_gpus == found.smallest_fit.gpus > min(p.gpus for p in found.points)
    assert [p.key for p in chart.panels] == ["tokens_per_s", "tokens_per_s_per_gpu", "days", "cost"]
    assert chart.stops_paying_after == found.stopped_paying_at


def test_70b_figure_draws_the_data_and_marks_the_recommended_count(sweep_70b):
    _, chart = sweep_70b
    fig = draw_scaling_chart(chart)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 4
    for ax, panel in zip(axes, chart.panels, strict=True):
        assert ax.get_xscale() == "log" and ax.get_xlabel() == "GPUs (log scale)"
        assert ax.get_ylabel() == panel.ylabel
        xs, ys = _line(ax, panel.ylabel).get_data()
        assert list(xs) == [p.gpus for p in chart.fitting]
        assert list(ys) == pytest.approx([getattr(p, panel.key) for p in chart.fitting])
        star = _line(ax, f"recommended ({chart.recommended_gpus})")
        assert star.get_marker() == "*"
        assert list(star.get_data()[0]) == [chart.recommended_gpus]
        assert [int(t.get_text()) for t in ax.get_xticklabels()] == chart.x_counts
        assert chart.no_fit_label in [t.get_text() for t in ax.texts]  # counts below the smallest fit shaded
    linear = _line(axes[0], f"linear from {chart.smallest_fit_gpus} GPUs")
    first = chart.fitting[0]
    assert list(linear.get_data()[1]) == pytest.approx([first.tokens_per_s * p.gpus / first.gpus
                                                        for p in chart.fitting])
    assert chart.recommended_label in fig.get_suptitle() and chart.scaling_label in fig.get_suptitle()
    assert "days to train 2T tokens" in [ax.get_title() for ax in axes]
    fig.clf()


def _chart(stops, band=None) -> ScalingChart:
    points = tuple(ScalingPoint(n, tps, True, band=band) for n, tps in ((8, 1000.0), (16, 1900.0), (32, 2400.0)))
    return ScalingChart("toy", (ScalingPoint(4, 0.0, False), *points), 16, 8, stops, ())


def test_where_scaling_stops_paying_is_shaded():
    chart = _chart(16)
    fig = draw_scaling_chart(chart)
    ax = fig.axes[0]
    assert "stops paying" in [t.get_text() for t in ax.texts]
    assert f"after 16 GPUs (next doubling < {SCALING_WORTH_IT:.0%}" in chart.scaling_label
    assert [p.key for p in chart.panels] == ["tokens_per_s", "tokens_per_s_per_gpu"]  # no --tokens, no days
    fig.clf()
    assert "every doubling pays up to 32" in _chart(None).scaling_label


def test_an_uncertainty_band_is_drawn_where_points_carry_one():
    chart = _chart(None, band=(0.9, 1.1))
    point = chart.fitting[0]
    assert chart.band_of(point, "tokens_per_s") == pytest.approx((900.0, 1100.0))
    fig = draw_scaling_chart(chart)
    bands = [c for c in fig.axes[0].collections if c.get_label() == "uncertainty"]
    assert len(bands) == 1
    low, high = bands[0].get_paths()[0].vertices[:, 1].min(), bands[0].get_paths()[0].vertices[:, 1].max()
    assert low == pytest.approx(900.0) and high == pytest.approx(2400.0 * 1.1)
    assert not any(c.get_label() == "uncertainty" for c in draw_scaling_chart(_chart(None)).axes[0].collections)
