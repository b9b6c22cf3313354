"""`plan --png`: the memory picture of a plan, checked from its bars and the figure drawn from them."""

from __future__ import annotations

import pytest

from planner.charts.memory import MemoryChart, draw_memory_chart, ranked_panel, stage_panel
from planner.cli.plan import search_plan
from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.model.load import load_model
from planner.plan import MEMORY_CATEGORIES
from planner.search.candidates import Pins
from planner.search.explain import short
from planner.training import TrainingSpec
from topologies.hardware import GIB, get_gpu

H100 = get_gpu("h100-sxm")


@pytest.fixture(scope="module")
def plan_13b():
    return search_plan("13B", "dgx-h100", 16, (), None, None, Pins(), "meshplan", None, 5)


def _bar_heights(ax) -> list[float]:
    """Stacked height per x position, from the rectangles matplotlib drew (the outline of a marked bar excluded)."""
    totals: dict[float, float] = {}
    for container in ax.containers:
        for rect in container:
            if rect.get_fill():
                x = round(rect.get_x() + rect.get_width() / 2, 6)
                totals[x] = totals.get(x, 0.0) + rect.get_height()
    return [totals[x] for x in sorted(totals)]


def test_stages_first_middle_last_against_capacity(plan_13b):
    plan, result = plan_13b
    best = result.ranked[0]
    memory, layout = best.result.memory, best.layout
    panel = stage_panel(memory, layout)
    pp = layout.pp
    stages = sorted({0, pp // 2, pp - 1, memory.worst_stage})
    assert len(panel.bars) == len(stages)
    per_stage = layout.world_size // pp
    for bar, stage in zip(panel.bars, stages, strict=True):
        assert bar.breakdown_bytes == dict(memory.per_stage[stage])
        assert f"ranks {stage * per_stage}-{stage * per_stage + per_stage - 1}" in bar.label
        assert bar.marked == (stage == memory.worst_stage)
    assert "first stage (0)" in panel.bars[0].label and "last stage" in panel.bars[-1].label
    worst = next(b for b in panel.bars if b.marked)
    assert worst.total_bytes == memory.peak_bytes  # the worst stage's bar is the plan's peak
    chart = MemoryChart("13B", (panel, ranked_panel(result.ranked, short)), H100.memory_bytes,
                        int(0.95 * H100.memory_bytes))
    fig = draw_memory_chart(chart)
    ax_stages, ax_ranked = fig.axes
    assert _bar_heights(ax_stages) == pytest.approx([b.total_bytes / GIB for b in panel.bars])
    assert _bar_heights(ax_ranked) == pytest.approx([s.result.memory.peak_bytes / GIB for s in result.ranked])
    assert [t.get_text() for t in ax_stages.get_xticklabels()] == [b.label for b in panel.bars]
    assert ax_stages.get_ylabel() == "GiB per GPU"
    lines = {line.get_label(): line.get_ydata()[0] for line in ax_stages.lines}
    assert lines["GPU memory"] == pytest.approx(80.0) and lines["planning limit (95%)"] == pytest.approx(76.0)
    legend = [t.get_text() for t in ax_ranked.get_legend().get_texts()]
    assert set(MEMORY_CATEGORIES) <= set(legend)
    fig.clf()


def test_one_stage_is_every_rank():
    model = load_model("13B")
    layout = Layout(dp_shard=16, zero_stage=3)
    memory = estimate_memory(model, TrainingSpec(seq_len=4096, global_batch_size=16), layout, H100)
    panel = stage_panel(memory, layout)
    assert [b.label for b in panel.bars] == ["every rank\nranks 0-15"]
    assert panel.bars[0].total_bytes == memory.peak_bytes and not panel.bars[0].marked
