"""The explanation's bubble and every change it suggests, checked against the simulator's own numbers.

Llama-3-8B on 8x A100-40GB with 4 pipeline stages on 1F1B used to read "a 19% pipeline bubble ...
--global-batch 512 would cut it": 1F1B's own bubble there is ~1% ((p - 1) / (m + p - 1) with
m = 256, p = 4), the rest is the last stage's output layer, and the advice did not fit."""

from __future__ import annotations

import re

import pytest

from planner.cli.plan import search_plan
from planner.figures import percent, sig, thousands
from planner.search.advice import (
    Context,
    best_suggestion,
    bubble_split,
    larger_batch_options,
    wider_dp_options,
)
from planner.search.candidates import Pins
from planner.search.explain import advice_context
from planner.simulate.pipeline import simulate_pipeline
from planner.simulate.step import simulate_step, step_memory
from topologies.hardware import GIB


def plan_of(model, cluster, gpus, **pins):
    batch = pins.pop("global_batch", None)
    seq = pins.pop("seq_len", None)
    the_plan, result = search_plan(model, cluster, gpus, (), seq, batch, Pins(**pins), "meshplan", None, 5)
    return the_plan, result, advice_context(result, the_plan.cluster, the_plan.model)


@pytest.fixture(scope="module")
def issue_case():
    return plan_of("llama3-8b", "dgx-a100-40g", 8, pp=4, pp_schedule="1f1b")


def test_bubble_is_the_schedules_plus_stage_imbalance(issue_case):
    the_plan, result, ctx = issue_case
    best = result.best
    lay = best.layout
    assert (lay.pp, lay.grad_accum_steps, lay.pp_schedule) == (4, 256, "1f1b")
    split = bubble_split(ctx, best.training, lay)
    step = best.result.step_time_s
    assert split.bubble_s == pytest.approx(best.result.time_breakdown_s["bubble"])  # the simulator's own figure
    assert split.schedule_s + split.imbalance_s == pytest.approx(split.bubble_s)
    # 1F1B's closed form for balanced stages: (p - 1) / (m + p - 1) of the step, here ~1.2%
    closed = (lay.pp - 1) / (lay.grad_accum_steps + lay.pp - 1)
    assert split.schedule_s / step == pytest.approx(closed, rel=0.25)
    assert split.imbalance_s / step > 0.15 and split.heavy_chunk == lay.pp - 1  # the output layer's stage
    text = " ".join(the_plan.explanation)
    assert f"{percent(split.schedule_s / step)} the 1f1b schedule's own" in text
    assert f"{percent(split.imbalance_s / step)} stage imbalance" in text and "last stage" in text
    assert "--global-batch" not in text  # a larger batch does not touch imbalance: no such advice


def test_balanced_reference_is_the_schedule_alone():
    """Equal chunks: the reference run's idle is all schedule (no imbalance), as the split assumes."""
    f, b, n, p = 1.0, 2.0, 16, 4
    run = simulate_pipeline("1f1b", p, 1, n, [[f] * p, [b] * p, [0.0] * p], [0.0] * p)
    idle = run.rank_end_s[0] - run.rank_busy_s[0]
    assert idle == pytest.approx((p - 1) * (f + b))


def test_larger_batch_suggested_only_with_the_simulated_gain(issue_case):
    the_plan, result, ctx = plan_of("llama3-8b", "dgx-a100-40g", 8, pp=4, pp_schedule="1f1b", global_batch=16)
    best = result.best
    split = bubble_split(ctx, best.training, best.layout)
    assert split.schedule_s / best.result.step_time_s > 0.10
    found = best_suggestion(ctx, best.result, larger_batch_options(best.training, best.layout))
    # the suggested layout, simulated independently: same numbers, fits, faster per token
    again = simulate_step(ctx.model, found.training, found.layout, ctx.cluster, ctx.calibration, ctx.engine)
    assert found.result.tokens_per_s == pytest.approx(again.tokens_per_s)
    assert again.memory.peak_bytes <= ctx.capacity_bytes
    assert found.gain == pytest.approx(again.tokens_per_s / best.result.tokens_per_s - 1) and found.gain > 0.01
    sentence = next(s for s in the_plan.explanation if s.startswith("The global batch limits this layout"))
    assert found.change in sentence and found.change == "--global-batch 32"
    assert thousands(again.tokens_per_s) in sentence and percent(found.gain) in sentence
    assert f"{sig(again.memory.peak_bytes / GIB)} GiB" in sentence


def test_a_change_that_does_not_fit_or_help_is_not_shown(issue_case):
    _, result, ctx = issue_case
    best = result.best
    options = larger_batch_options(best.training, best.layout)
    # it would help a little, but less than WORTH_SUGGESTING: m = 256 already amortizes the warm-up
    assert best_suggestion(ctx, best.result, options) is None
    tight = Context(ctx.model, ctx.cluster, ctx.calibration, ctx.engine, best.result.memory.peak_bytes - 1)
    small = plan_of("llama3-8b", "dgx-a100-40g", 8, pp=4, pp_schedule="1f1b", global_batch=16)[1].best
    assert best_suggestion(tight, small.result, larger_batch_options(small.training, small.layout)) is None


@pytest.mark.parametrize("pins, shown", [({"global_batch": 2}, False), ({"global_batch": 1, "tp": 8}, True)])
def test_dp_cap_advice_is_simulated(pins, shown):
    """At one sequence per replica, a suggestion to grow dp is shown exactly when a layout the simulator ran
    with twice the batch and dp (GPUs from tp or pp) fits and is faster: TP 8 on one sequence gains from TP 4 x DP 2."""
    the_plan, result, ctx = plan_of("llama3-8b", "dgx-h100", 8, seq_len=4096, **pins)
    best = result.best
    sentence = next((s for s in the_plan.explanation if s.startswith("The global batch limits data")), None)
    options = wider_dp_options(best.training, best.layout)
    results = []
    for _change, training, layout in options:
        try:
            results.append(simulate_step(ctx.model, training, layout, ctx.cluster, ctx.calibration, ctx.engine))
        except Exception:  # noqa: BLE001 - an option the planner rejects is simply not a suggestion
            continue
    fitting = [r for r in results if r.memory.peak_bytes <= ctx.capacity_bytes]
    faster = [r for r in fitting if r.tokens_per_s > 1.01 * best.result.tokens_per_s]
    if best.layout.dp != best.training.global_batch_size:
        assert sentence is None
        return
    assert (sentence is not None) == bool(faster) == shown
    if sentence:
        top = max(faster, key=lambda r: r.tokens_per_s)
        assert thousands(top.tokens_per_s) in sentence


def test_memory_claims_are_checked(issue_case):
    the_plan, result, ctx = issue_case
    best = result.best
    text = " ".join(the_plan.explanation)
    claim = re.search(r"rules out micro-batch (\d+) \(([\d.]+) GiB\)", text)
    assert claim, text
    lay = best.layout
    bigger = lay.replace(micro_batch_size=int(claim.group(1)), grad_accum_steps=lay.grad_accum_steps // 2)
    need = step_memory(ctx.model, best.training, bigger, ctx.cluster, ctx.calibration, ctx.engine).peak_bytes
    assert need > ctx.capacity_bytes and claim.group(2) == sig(need / GIB)
