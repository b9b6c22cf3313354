"""planner.search.sweep: --gpus parsing, the counts a cluster allows, where scaling stops paying, cost."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planner.search.sweep import (
    AUTO_MAX_GPUS,
    SCALING_WORTH_IT,
    allowed_counts,
    parse_gpus,
    parse_tokens,
    sweep,
    training_cost,
)
from topologies.cluster import MAX_WORLD_SIZE
from topologies.errors import UsageError


def test_parse_gpus():
    assert (parse_gpus("64").lo, parse_gpus("64").hi, parse_gpus("64").is_sweep) == (64, 64, False)
    r = parse_gpus(" 8 - 512 ")
    assert (r.lo, r.hi, r.is_sweep) == (8, 512, True)
    auto = parse_gpus("AUTO")
    assert auto.auto and auto.hi == AUTO_MAX_GPUS
    for bad in ("0", "-4", "8-4", "x", "1e3", "", "nan", str(MAX_WORLD_SIZE + 1), "99999999999"):
        with pytest.raises(UsageError):
            parse_gpus(bad)


def test_allowed_counts_are_powers_of_two_then_whole_nodes():
    assert allowed_counts(8, 1, 100) == [1, 2, 4, 8, 16, 32, 64]
    assert allowed_counts(6, 1, 50) == [1, 2, 4, 6, 12, 24, 48]
    assert allowed_counts(8, 20, 64) == [32, 64]
    assert allowed_counts(8, 9, 15) == []


def test_parse_tokens():
    assert parse_tokens("15T") == 15e12
    assert parse_tokens("300b") == 300e9
    assert parse_tokens("2.5e12") == 2.5e12
    for bad in ("-1T", "0", "nan", "inf", "15X", "", "1e30"):
        with pytest.raises(UsageError):
            parse_tokens(bad)


def _result(fits: bool, tokens_per_s: float = 0.0, needed: int = 0, capacity: int = 1):
    best = SimpleNamespace(result=SimpleNamespace(tokens_per_s=tokens_per_s, mfu=0.4, step_time_s=1.0),
                           layout=None, training=None)
    miss = SimpleNamespace(needed_bytes=needed, capacity_bytes=capacity, what="model state")
    return SimpleNamespace(ranked=(best,) if fits else (), best=best, near_miss=None if fits else miss)


def test_sweep_skips_counts_model_state_rules_out_and_stops_where_scaling_stops_paying():
    searched = []
    throughput = {16: 100.0, 32: 200.0, 64: 390.0, 128: 390.0 * 2 * SCALING_WORTH_IT * 0.9, 256: 1e9}

    def at(n):
        searched.append(n)
        if n < 16:  # state needs 14x the capacity at 1 GPU: nothing below 14 GPUs can fit
            return _result(False, needed=14 * 100 // n, capacity=100)
        return _result(True, throughput[n])

    found = sweep([1, 2, 4, 8, 16, 32, 64, 128, 256], at, auto=True)
    assert searched == [1, 16, 32, 64, 128]  # 2-8 ruled out; stopped after the doubling that did not pay
    assert found.ruled_out == (2, 4, 8)
    assert found.smallest_fit.gpus == 16
    assert found.stopped_paying_at == 64
    # the most tokens/s per GPU: 16 and 32 GPUs tie at 6.25 per GPU, the smaller count wins; 64 gives 6.09
    assert found.recommended.gpus == 16


def test_recommended_is_the_most_tokens_per_gpu_so_the_cheapest():
    rates = {8: 80.0, 16: 176.0, 32: 320.0}  # 10, 11, 10 tokens/s per GPU
    found = sweep([8, 16, 32], lambda n: _result(True, rates[n]), auto=False)
    assert found.recommended.gpus == 16
    costs = {n: training_cost(1e9, rates[n], n, 2.0)["cost"] for n in rates}
    assert min(costs, key=costs.get) == 16
    assert sweep([8], lambda n: _result(False, needed=2, capacity=1), auto=False).recommended is None


def test_sweep_of_a_range_searches_every_count_and_skips_refused_ones():
    def at(n):
        if n == 32:
            raise UsageError("pins do not divide 32")
        return _result(True, 10.0 * n)

    found = sweep([16, 32, 64, 128, 256, 512], at, auto=False)
    assert [p.gpus for p in found.points] == [16, 64, 128, 256, 512]
    assert found.stopped_paying_at is None


def test_training_cost():
    cost = training_cost(1e12, 1e6, 100, 2.0)
    assert cost["days"] == pytest.approx(1e6 / 86400)
    assert cost["gpu_hours"] == pytest.approx(1e6 / 3600 * 100)
    assert cost["cost"] == pytest.approx(cost["gpu_hours"] * 2.0)
    assert "cost" not in training_cost(1e12, 1e6, 100, None)
