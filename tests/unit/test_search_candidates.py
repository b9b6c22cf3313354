"""The candidate space: hard constraints, pins, batch arithmetic (pure functions, no simulation)."""

from __future__ import annotations

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.search.candidates import (
    Pins,
    check_pins,
    data_parallel_splits,
    divisors,
    global_batch_for,
    mesh_degrees,
    pipeline_allows,
    schedules,
    sequence_parallel_options,
    shapes,
)
from topologies.errors import UsageError


@pytest.mark.parametrize("n", [1, 2, 12, 16, 36, 97, 360, 16384])
def test_divisors_match_brute_force(n):
    assert divisors(n) == tuple(d for d in range(1, n + 1) if n % d == 0)


def test_mesh_degrees_cover_every_valid_factorization():
    """Every (pp, dp, cp, tp) with the right product and the hard rules, and nothing else."""
    model = load_model("13B")  # 40 heads, 40 layers
    got = set(mesh_degrees(16, model, 4096, Pins()))
    expected = {(pp, dp, cp, tp)
                for tp in divisors(16) for pp in divisors(16) for cp in divisors(16) for dp in divisors(16)
                if tp * pp * cp * dp == 16 and 40 % tp == 0 and pp <= 40 and 4096 // cp >= 1024}
    assert got == expected
    assert all(40 % tp == 0 for _, _, _, tp in got)  # tp 16 cannot split 40 heads


def test_gqa_limits_tp_to_kv_heads():
    model = load_model("debug")  # 4 heads, 2 KV heads
    assert {tp for *_, tp in mesh_degrees(8, model, 64, Pins(cp=1))} == {1, 2}


def test_pinned_degrees_are_the_only_ones():
    model = load_model("13B")
    pins = Pins(tp=4, pp=2)
    assert {(pp, tp) for pp, _, _, tp in mesh_degrees(16, model, 4096, pins)} == {(2, 4)}
    assert set(mesh_degrees(16, model, 4096, Pins(dp=4, tp=2))) == {(2, 4, 1, 2), (1, 4, 2, 2)}


def test_zero_stage_zero_iff_unsharded():
    splits = list(data_parallel_splits(8, Pins()))
    assert (8, 1, 0) in splits and (1, 8, 3) in splits and (2, 4, 2) in splits
    assert all((zero == 0) == (shard == 1) for _, shard, zero in splits)
    assert all(rep * shard == 8 for rep, shard, _ in splits)
    assert list(data_parallel_splits(8, Pins(zero_stage=0))) == [(8, 1, 0)]
    assert list(data_parallel_splits(8, Pins(dp_shard=4, zero_stage=3))) == [(2, 4, 3)]
    # the cp ranks alone can be ZeRO's group (FSDP 1 x CP 8), as ZeRO-2/3 beside plain replication
    assert list(data_parallel_splits(1, Pins(), cp=8)) == [(1, 1, 0), (1, 1, 2), (1, 1, 3)]
    assert list(data_parallel_splits(1, Pins())) == [(1, 1, 0)]
    assert (2, 1, 3) not in data_parallel_splits(2, Pins(), cp=8)  # with replicas: dp_shard > 1 only
    with pytest.raises(UsageError, match="--cp > 1"):
        Pins(dp_shard=1, zero_stage=3)
    Pins(dp_shard=1, zero_stage=3, cp=8)  # accepted: the cp ranks shard


def test_sequence_parallel_rule():
    assert sequence_parallel_options(1, 1, 4096, Pins()) == (False,)
    assert sequence_parallel_options(4, 1, 4096, Pins()) == (True, False)
    assert sequence_parallel_options(4, 1, 4098, Pins()) == (False,)  # seq does not split 4 ways
    assert sequence_parallel_options(4, 1, 4096, Pins(sequence_parallel=False)) == (False,)
    assert sequence_parallel_options(4, 1, 4098, Pins(sequence_parallel=True)) == ()


def test_schedules_respect_layers():
    assert schedules(1, 40, Pins()) == (("1f1b", 1),)
    four = schedules(4, 40, Pins())  # 10 layers per stage: v in 2, 5, 10
    assert ("interleaved-1f1b", 5) in four and ("interleaved-1f1b", 3) not in four
    assert ("zb-v", 2) in four
    assert all(4 * v <= 40 for _, v in four)
    assert ("zb-v", 2) not in schedules(32, 40, Pins())  # 64 chunks > 40 layers
    assert schedules(4, 40, Pins(pp_schedule="zb-v")) == (("zb-v", 2),)
    assert schedules(1, 40, Pins(pp_schedule="zb-v")) == ()


def test_pipeline_micro_batch_rules():
    one_f = Layout(pp=4, dp_replicate=1, pp_schedule="1f1b")
    assert not pipeline_allows(one_f, 3) and pipeline_allows(one_f, 4)
    gpipe = one_f.replace(pp_schedule="gpipe")
    assert pipeline_allows(gpipe, 3) and pipeline_allows(gpipe, 4)
    inter = one_f.replace(pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert pipeline_allows(inter, 8) and not pipeline_allows(inter, 6)


def test_global_batch_rounding():
    assert global_batch_for(8, 8, 256, fixed=False) == 256
    assert global_batch_for(24, 24, 256, fixed=False) == 264  # nearest multiple of 24
    assert global_batch_for(512, 512, 256, fixed=False) is None  # would double the batch
    assert global_batch_for(3, 3, 8, fixed=True) is None
    assert global_batch_for(2, 4, 8, fixed=True) == 8


def test_shapes_are_valid_layouts_with_the_right_world_size():
    model = load_model("13B")
    seen = list(shapes(16, model, 4096, Pins(), "none"))
    assert seen and all(s.world_size == 16 for s in seen)
    assert all(s.tp > 1 for s in seen if s.sequence_parallel)
    assert {s.sequence_parallel for s in seen if s.tp > 1} == {True, False}
    assert len({s.mesh_shape for s in seen}) > 10


@pytest.mark.parametrize("pins, fragment", [
    (dict(tp=3), "--tp 3 must divide"),
    (dict(pp=50), "exceeds the 40 layers"),
    (dict(tp=2, dp=3), "does not divide the 16 GPUs"),
    (dict(cp=3), "--cp 3 must divide"),
])
def test_check_pins_rejects_impossible_pins(pins, fragment):
    with pytest.raises(UsageError, match=fragment):
        check_pins(16, load_model("13B"), 4096, None, Pins(**pins))


def test_pins_validate_their_own_consistency():
    with pytest.raises(UsageError, match="--dp-shard must be 1"):
        Pins(zero_stage=0, dp_shard=2)
    with pytest.raises(UsageError, match="needs --tp > 1"):
        Pins(tp=1, sequence_parallel=True)
    with pytest.raises(UsageError):
        Pins(pp_schedule="zb-v", virtual_stages=3)
    with pytest.raises(UsageError, match="multiple of dp"):
        check_pins(4, load_model("debug"), 64, 6, Pins(dp=4))
