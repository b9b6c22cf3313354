"""Pipeline schedules as events: closed-form bubbles where they exist, invariants everywhere."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.simulate.pipeline import B, F, W, chunk_owner, simulate_pipeline
from topologies.errors import PlanError


def uniform(pp: int, v: int, f: float, b: float, w: float = 0.0) -> list[list[float]]:
    return [[f] * (pp * v), [b] * (pp * v), [w] * (pp * v)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,n", [(1, 1), (2, 4), (4, 8), (8, 8), (4, 32)])
def test_bubble_of_uniform_stages_matches_the_closed_form(schedule, pp, n):
    """GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021): (n + pp - 1) * (f + b)."""
    f, b = 1.0, 2.0
    result = simulate_pipeline(schedule, pp, 1, n, uniform(pp, 1, f, b), [0.0] * pp)
    assert result.makespan_s == pytest.approx((n + pp - 1) * (f + b))


@pytest.mark.parametrize("pp,v,n", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)])
def test_interleaved_bubble_shrinks_by_the_virtual_stages(pp, v, n):
    """Narayanan et al. 2021, sec. 2.2.2: bubble (pp - 1) * (f + b) / v with n a multiple of pp."""
    f, b = 1.0, 2.0  # per rank: each of its v chunks takes f/v and b/v
    result = simulate_pipeline("interleaved-1f1b", pp, v, n, uniform(pp, v, f / v, b / v), [0.0] * pp * v)
    assert result.makespan_s == pytest.approx(n * (f + b) + (pp - 1) * (f + b) / v)


@pytest.mark.parametrize("pp,n", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_v_beats_1f1b_and_respects_the_work_bound(pp, n):
    f = b = w = 0.5  # per chunk; a rank holds 2 chunks: 2 * (f + b + w) per micro-batch
    zbv = simulate_pipeline("zb-v", pp, 2, n, uniform(pp, 2, f, b, w), [0.0] * 2 * pp)
    one_f_one_b = (n + pp - 1) * 2 * (f + b + w)
    assert n * 2 * (f + b + w) <= zbv.makespan_s + 1e-9
    assert zbv.makespan_s < one_f_one_b
    assert all(busy == pytest.approx(n * 2 * (f + b + w)) for busy in zbv.rank_busy_s)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                        ("zb-v", 2)])
def test_schedules_run_every_operation_once_in_dependency_order(schedule, v):
    for pp, n in itertools.product((1, 2, 3, 4), (1, 2, 3, 5, 8)):
        if schedule == "interleaved-1f1b":
            n *= pp  # groups of pp micro-batches (Megatron's rule)
        chunks = pp * v
        durations = [[1.0 + 0.1 * c for c in range(chunks)], [2.0] * chunks, [0.5 if schedule == "zb-v" else 0.0] * chunks]
        lags = [0.05] * chunks
        result = simulate_pipeline(schedule, pp, v, n, durations, lags, events=True)
        kinds = (F, B, W) if schedule == "zb-v" else (F, B)
        assert len(result.ops) == len(kinds) * chunks * n
        end = {(op.kind, op.chunk, op.micro_batch): op for op in result.ops}
        owner = chunk_owner(schedule, pp, v)
        for op in result.ops:
            assert op.end_s - op.start_s == pytest.approx(durations[op.kind][op.chunk])
            if op.kind == F and op.chunk > 0:
                src = end[(F, op.chunk - 1, op.micro_batch)]
                lag = lags[op.chunk - 1] if owner[op.chunk - 1] != op.rank else 0.0
                assert op.start_s >= src.end_s + lag - 1e-9
            if op.kind == B:
                assert op.start_s >= end[(F, op.chunk, op.micro_batch)].end_s - 1e-9
                if op.chunk < chunks - 1:
                    assert op.start_s >= end[(B, op.chunk + 1, op.micro_batch)].end_s - 1e-9
            if op.kind == W:
                assert op.start_s >= end[(B, op.chunk, op.micro_batch)].end_s - 1e-9
        for rank in range(pp):  # one operation at a time on a rank
            mine = sorted((op.start_s, op.end_s) for op in result.ops if op.rank == rank)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(mine, mine[1:], strict=False))
        assert result.makespan_s == pytest.approx(max(op.end_s for op in result.ops))


def test_imbalanced_stage_sets_the_pace():
    """A stage 50% slower than the rest: the steady state runs at its rate, so every micro-batch pays it."""
    pp, n = 4, 32
    durations = uniform(pp, 1, 1.0, 2.0)
    durations[F][pp - 1], durations[B][pp - 1] = 1.5, 3.0
    result = simulate_pipeline("1f1b", pp, 1, n, durations, [0.0] * pp)
    assert result.makespan_s >= n * 4.5
    assert result.makespan_s > simulate_pipeline("1f1b", pp, 1, n, uniform(pp, 1, 1.0, 2.0), [0.0] * pp).makespan_s


def test_slower_links_never_speed_a_pipeline_up():
    pp, n = 4, 8
    times = [simulate_pipeline("1f1b", pp, 1, n, uniform(pp, 1, 1.0, 2.0), [lag] * pp).makespan_s
             for lag in (0.0, 0.1, 0.5, 2.0)]
    assert times == sorted(times)
    assert times[-1] > times[0]


def test_fewer_micro_batches_than_stages_still_runs():
    result = simulate_pipeline("1f1b", 8, 1, 2, uniform(8, 1, 1.0, 2.0), [0.0] * 8)
    assert result.makespan_s == pytest.approx((2 + 8 - 1) * 3.0)


def test_last_backward_is_the_final_micro_batch_backward():
    result = simulate_pipeline("1f1b", 4, 1, 8, uniform(4, 1, 1.0, 2.0), [0.0] * 4)
    assert result.last_backward_s == (2.0, 2.0, 2.0, 2.0)


def test_bad_inputs_are_plan_errors():
    with pytest.raises(PlanError, match="multiple"):
        simulate_pipeline("interleaved-1f1b", 4, 2, 6, uniform(4, 2, 1.0, 1.0), [0.0] * 8)
    with pytest.raises(PlanError):
        simulate_pipeline("1f1b", 2, 1, 0, uniform(2, 1, 1.0, 1.0), [0.0] * 2)
    with pytest.raises(PlanError):
        simulate_pipeline("looped-bfs", 2, 1, 2, uniform(2, 1, 1.0, 1.0), [0.0] * 2)


def _random_case(schedule, pp, v, n, seed):
    rng = random.Random(seed)
    chunks = pp * v
    durations = [[rng.uniform(0.5, 2.0) for _ in range(chunks)] for _ in range(3)]
    if schedule != "zb-v":
        durations[W] = [0.0] * chunks
    return durations, [rng.choice((0.0, rng.uniform(0.0, 0.5))) for _ in range(chunks)]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                        ("zb-v", 2)])
def test_every_operation_starts_as_soon_as_its_rank_and_input_allow(schedule, v):
    """Exactness: each start is max(end of the rank's previous operation, arrival of its input), nothing later.

    Together with the dependency test above this pins the event simulation to
    the earliest schedule of each rank's order, whatever order it computes in.
    """
    for pp, n in itertools.product((1, 2, 3, 5), (1, 2, 4, 7)):
        n *= pp if schedule == "interleaved-1f1b" else 1
        durations, lags = _random_case(schedule, pp, v, n, seed=pp * 100 + n)
        ops = simulate_pipeline(schedule, pp, v, n, durations, lags, events=True).ops
        end = {(op.kind, op.chunk, op.micro_batch): op.end_s for op in ops}
        owner = chunk_owner(schedule, pp, v)
        previous_end = {}
        for op in sorted(ops, key=lambda o: (o.rank, o.start_s)):
            ready = previous_end.get(op.rank, 0.0)
            src = op.chunk - 1 if op.kind == F else op.chunk + 1
            if op.kind != W and 0 <= src < pp * v:
                lag = lags[min(src, op.chunk)] if owner[src] != op.rank else 0.0
                ready = max(ready, end[(op.kind, src, op.micro_batch)] + lag)
            assert op.start_s == pytest.approx(ready, abs=1e-12)
            previous_end[op.rank] = op.end_s


def test_array_orders_are_the_listed_orders():
    """_compiled builds GPipe, 1F1B and interleaved 1F1B orders with numpy (`_rank_arrays`); they are the
    per-rank lists of `_ORDERS` operation by operation, warm-up, steady state and cool-down."""
    from planner.simulate.pipeline import _ORDERS, _rank_arrays

    checked = 0
    for schedule, virtual in (("gpipe", (1, 2)), ("1f1b", (1,)), ("interleaved-1f1b", (2, 3, 4))):
        for pp in (1, 2, 3, 4, 8):
            for v in virtual:
                for n in range(1, 3 * pp + 2):
                    if schedule == "interleaved-1f1b" and n % pp:
                        continue
                    for rank in range(pp):
                        listed = [list(op) for op in _ORDERS[schedule](rank, pp, v, n)]
                        assert _rank_arrays(schedule, rank, pp, v, n).tolist() == listed, (schedule, pp, v, n, rank)
                        checked += 1
    assert checked > 300
