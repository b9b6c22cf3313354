"""planner.search.replan: a plan searched again for the GPUs a job has now, against `meshplan plan` itself."""

from __future__ import annotations

import dataclasses

import pytest

from planner.cli.plan import search_plan
from planner.plan import Plan
from planner.search.candidates import Pins
from planner.search.replan import replan
from topologies.cluster_load import load_cluster
from topologies.errors import InfeasibleError, TopologyError

COMMON = dict(seq_len=64, global_batch=8, engine="meshplan", calibration=None, top=5)


def _plan(gpus: int, cluster: str = "cpu", **pins) -> Plan:
    return search_plan("debug", cluster, gpus, (), pins=Pins(**pins), **COMMON)[0]


def test_plan_records_how_it_was_searched():
    plan = _plan(4, dp=4, dp_shard=4, zero_stage=3, micro_batch_size=2, recompute="none")
    assert plan.search == {"pins": {"dp": 4, "dp_shard": 4, "zero_stage": 3, "micro_batch_size": 2,
                                    "recompute": "none"}, "usable_memory_fraction": 0.95, "calibration": None}
    assert Plan.from_json(plan.to_json()).search == plan.search
    assert Pins.from_json(plan.search["pins"]) == Pins(dp=4, dp_shard=4, zero_stage=3, micro_batch_size=2,
                                                       recompute="none")


def test_four_ranks_to_two_is_what_plan_gives_for_two_and_back():
    four = _plan(4, dp=4, dp_shard=4, zero_stage=3, micro_batch_size=2, recompute="none")
    down = replan(four, 1, 2)
    by_hand = _plan(2, zero_stage=3, micro_batch_size=2, recompute="none")  # the pins that still hold on 2
    assert down.new.layout == by_hand.layout and down.new.cluster == by_hand.cluster
    assert down.new.prediction == by_hand.prediction
    assert down.dropped == {"dp": 4, "dp_shard": 4} and down.kept == Pins(zero_stage=3, micro_batch_size=2,
                                                                           recompute="none")
    assert down.new.search["pins"] == four.search["pins"]  # the original pins travel on
    lines = down.lines()
    assert lines[0].startswith("replan: 4 ranks planned (1 node x 4), 2 present (1 node x 2)")
    assert "was: tp1 pp1 dp4 Z3 mb2x1" in lines[1] and "now: tp1 pp1 dp2 Z3 mb2x2" in lines[2]
    assert "dropped (no longer valid): dp=4, dp_shard=4" in lines[3]
    back = replan(down.new, 1, 4)  # the GPUs are back: every original pin holds again
    assert back.new.layout == four.layout and back.dropped == {}


def test_nodes_lost_from_a_multi_node_plan():
    two_nodes = search_plan("debug", "cpu", 4, ("gpus_per_node=2",), pins=Pins(tp=2), **COMMON)[0]
    one = replan(two_nodes, 1, 2)
    assert (one.new.cluster.n_nodes, one.new.cluster.gpus_per_node) == (1, 2) and one.new.layout.tp == 2
    assert one.dropped == {}


def test_plan_without_a_search_record_replans_unpinned():
    old = dataclasses.replace(_plan(4, tp=2, zero_stage=0), search=None)
    new = replan(old, 1, 2).new
    assert new.layout == _plan(2).layout


def test_no_layout_on_the_gpus_left_is_exit_3():
    big = search_plan("7B", "dgx-h100", 8, (), pins=Pins(), **{**COMMON, "seq_len": 4096, "global_batch": 64})[0]
    with pytest.raises(InfeasibleError):
        replan(big, 1, 1)


def test_cluster_with_nodes():
    cluster = load_cluster("dgx-h100", 16)
    assert (cluster.with_nodes(1, 8).n_nodes, cluster.with_nodes(3, 4).gpus_per_node) == (1, 4)
    small = load_cluster("cpu", 2)
    assert small.with_nodes(2, 4).world_size == 8  # no measured link matrix: a node may grow back
    with pytest.raises(TopologyError):
        cluster.with_nodes(0, 8)
