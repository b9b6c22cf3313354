"""Layout validation and the rank grid."""

from __future__ import annotations

import pytest

from planner.layout import MESH_AXES, Layout, axis_groups, balanced_layers, rank_coords
from topologies.errors import PlanError


def test_tp_groups_are_consecutive_ranks():
    shape = Layout(tp=4, pp=2, dp_replicate=2).mesh_shape
    groups = axis_groups(shape, ("tp",))
    assert groups[0] == (0, 1, 2, 3) and groups[1] == (4, 5, 6, 7)
    assert len(groups) == 4


def test_pp_groups_stride_by_stage_size():
    shape = Layout(tp=2, pp=2, dp_shard=2, zero_stage=3).mesh_shape
    assert axis_groups(shape, ("pp",))[0] == (0, 4)
    assert axis_groups(shape, ("dp_shard",))[0] == (0, 2)


def test_flattened_dp_group_and_partition():
    shape = Layout(dp_replicate=2, dp_shard=2, tp=2, zero_stage=3).mesh_shape
    groups = axis_groups(shape, ("dp_replicate", "dp_shard"))
    assert groups[0] == (0, 2, 4, 6)
    every = sorted(r for g in groups for r in g)
    assert every == list(range(8))


@pytest.mark.parametrize("rank", range(24))
def test_rank_coords_inverse(rank):
    shape = (2, 1, 3, 1, 4)
    c = rank_coords(shape, rank)
    rebuilt = 0
    for axis, size in zip(MESH_AXES, shape, strict=True):
        rebuilt = rebuilt * size + c[axis]
    assert rebuilt == rank


def test_zero0_forbids_dp_shard():
    with pytest.raises(PlanError, match="dp_shard must be 1"):
        Layout(dp_shard=4, zero_stage=0)


def test_interleaved_needs_virtual_stages():
    with pytest.raises(PlanError, match="virtual_stages"):
        Layout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=1)


def test_balanced_layers():
    assert balanced_layers(40, 4) == (10, 10, 10, 10)
    assert sum(balanced_layers(30, 4)) == 30
    assert balanced_layers(30, 4) == (7, 8, 8, 7)
    with pytest.raises(PlanError):
        balanced_layers(2, 4)
