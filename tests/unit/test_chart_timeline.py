"""`simulate --png`: the folded step chart, checked from the data it is drawn from and the figure's text.

The main case is the 13B default plan (`plan --model 13B --gpus 16`, then `simulate --png`): 128
micro-batches on 4 stages, where drawing every operation gave a barcode.
"""

from __future__ import annotations

import pytest

from planner.charts.timeline import (
    EDGE_MICRO_BATCHES,
    FOLD_MIN_SHARE,
    draw_step_chart,
    plot_step_chart,
    step_chart,
)
from planner.cli.plan import search_plan
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import with_stage_layers
from planner.search.candidates import Pins
from planner.simulate.step import simulate_step
from planner.simulate.timeline import timeline_of
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster


@pytest.fixture(scope="module")
def default_13b():
    """The plan `meshplan plan --model 13B --gpus 16` writes, simulated with events as `simulate --png` does."""
    plan, _ = search_plan("13B", "dgx-h100", 16, (), None, None, Pins(), "meshplan", None, 5)
    result = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, events=True)
    return plan, result, step_chart(timeline_of(result, plan.layout), "13B default plan")


def test_13b_default_plan_folds_its_steady_state(default_13b):
    plan, result, chart = default_13b
    tl = chart.timeline
    n = plan.layout.grad_accum_steps
    assert n >= 64 and plan.layout.pp >= 2  # the case that drew a barcode: many micro-batches on a pipeline
    assert chart.edge_micro_batches == (0, 1, n - 2, n - 1) and EDGE_MICRO_BATCHES == 2
    assert len(chart.folds) == 1
    fold = chart.folds[0]
    assert fold.duration_s > FOLD_MIN_SHARE * tl.step_time_s
    assert fold.duration_s > 0.5 * tl.step_time_s  # most of a 128-micro-batch step is steady state
    ops = [i for i in tl.intervals if i.is_operation]
    drawn_ops = [i for i in chart.drawn if i.is_operation]
    # the edge micro-batches are drawn in full: every one of their operations, unclipped
    for i in ops:
        if i.micro_batch in chart.edge_micro_batches:
            assert i in chart.drawn
    # what lies wholly inside the fold is not drawn; the fold's count is those micro-batches on the busiest stage
    inside = [i for i in ops if i.start_s >= fold.start_s and i.end_s <= fold.end_s]
    assert not any(i in chart.drawn for i in inside)
    per_stage = [len({i.micro_batch for i in inside if i.stage == s}) for s in range(tl.pp)]
    assert fold.micro_batches == max(per_stage) and fold.micro_batches >= n - 2 * EDGE_MICRO_BATCHES - 2 * tl.pp
    assert str(fold.micro_batches) in fold.label and f"{fold.duration_s:.3g} s" in fold.label
    # a few percent of the operations are drawn, each wide enough to read
    assert len({(i.stage, i.kind, i.chunk, i.micro_batch) for i in drawn_ops}) < 0.25 * len(ops)
    # the drawn axis: the step less the fold plus its band, and times map onto it in order
    assert chart.x(tl.step_time_s) == pytest.approx(chart.drawn_span_s)
    assert chart.x(fold.start_s) + chart.fold_width_s == pytest.approx(chart.x(fold.end_s))
    for i in chart.drawn:
        assert not (fold.start_s < i.start_s < fold.end_s) and not (fold.start_s < i.end_s < fold.end_s)


def test_13b_default_plan_lanes_and_figure(default_13b, tmp_path):
    plan, result, chart = default_13b
    tl = chart.timeline
    assert chart.stages == tuple(range(plan.layout.pp))  # 4 stages: none folded
    assert chart.rows == tuple((s, lane) for s in chart.stages for lane in tl.lanes)
    assert tl.lanes[0] == "compute" and "PP" in tl.lanes and "DP" in tl.lanes
    for stage in chart.stages:  # the bubble drawn is the stage's idle time, less what the fold hides
        hidden = sum(max(0.0, min(i.end_s, f.end_s) - max(i.start_s, f.start_s)) for f in chart.folds
                     for i in tl.on(stage) if i.kind == "bubble")
        drawn = sum(i.duration_s for i in chart.drawn if i.stage == stage and i.kind == "bubble")
        assert drawn + hidden == pytest.approx(tl.bubble_s(stage))
    assert tl.bubble_s(result.critical_stage) == pytest.approx(result.time_breakdown_s["bubble"], abs=1e-9)
    fig = draw_step_chart(chart)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert [lab for lab in labels if lab.startswith("stage")] == [f"stage {s}" for s in chart.stages]
    assert labels.count("PP send") == plan.layout.pp
    texts = [t.get_text() for t in ax.texts]
    assert chart.folds[0].label in texts
    drawn_numbers = {int(t) for t in texts if t.isdigit()}  # micro-batch numbers written on operations
    assert {0, 1, tl.micro_batches - 1} <= drawn_numbers
    assert chart.subtitle in ax.get_title() and "128 micro-batches" in chart.subtitle
    assert ax.get_xlabel().startswith("time in step (s)")
    ticks = [float(t.get_text()) for t in ax.get_xticklabels()]
    assert ticks == sorted(ticks) and ticks[-1] > chart.folds[0].end_s  # real times on both sides of the fold
    import matplotlib.pyplot as plt

    plt.close(fig)
    path = tmp_path / "step.png"
    plot_step_chart(chart, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpipe_folds_its_forwards_and_its_backwards():
    model, cluster = load_model("13B"), load_cluster("dgx-h100", 16)
    layout = with_stage_layers(model, Layout(tp=4, pp=4, micro_batch_size=1, grad_accum_steps=32,
                                             pp_schedule="gpipe"))
    result = simulate_step(model, TrainingSpec(seq_len=4096, global_batch_size=32), layout, cluster, events=True)
    chart = step_chart(timeline_of(result, layout))
    assert len(chart.folds) == 2
    kinds = []
    for fold in chart.folds:
        inside = {i.kind for i in chart.timeline.intervals if i.is_operation and i.start_s >= fold.start_s
                  and i.end_s <= fold.end_s}
        kinds.append(inside)
    assert kinds == [{"F"}, {"B"}]


def test_long_pipelines_fold_their_middle_stages():
    model, cluster = load_model("405B"), load_cluster("dgx-h100", 1024)
    layout = with_stage_layers(model, Layout(tp=8, pp=16, dp_replicate=8, micro_batch_size=1, grad_accum_steps=64,
                                             sequence_parallel=True, recompute="full"))
    result = simulate_step(model, TrainingSpec(seq_len=4096, global_batch_size=512), layout, cluster, events=True)
    chart = step_chart(timeline_of(result, layout))
    assert chart.stages[:3] == (0, 1, 2) and chart.stages[-3:] == (13, 14, 15)
    assert result.critical_stage in chart.stages and len(chart.stages) <= 7
    assert {i.stage for i in chart.drawn} == set(chart.stages)
    fig = draw_step_chart(chart)
    texts = [t.get_text() for t in fig.axes[0].texts]
    fig.clf()
    hidden = chart.hidden_stages
    assert any(f"stages {hidden[0]}-{hidden[-1]} folded" in t for t in texts)


def test_short_steps_are_not_folded():
    model, cluster = load_model("13B"), load_cluster("dgx-h100", 16)
    layout = with_stage_layers(model, Layout(tp=4, pp=2, dp_replicate=2, micro_batch_size=1, grad_accum_steps=4))
    result = simulate_step(model, TrainingSpec(seq_len=4096, global_batch_size=8), layout, cluster, events=True)
    chart = step_chart(timeline_of(result, layout))
    assert chart.folds == () and chart.drawn_span_s == pytest.approx(result.step_time_s)
    assert len([i for i in chart.drawn if i.is_operation]) == 2 * 2 * 4
