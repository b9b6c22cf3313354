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


def test_zero_shards_over_dp_shard_and_cp():
    """ZeRO's group is dp_shard x cp (Megatron's dp-cp group, torchtitan's dp_shard_cp, DeepSpeed's
    seq_data_parallel_group); gradients average over every data-parallel axis and cp."""
    layout = Layout(cp=8, zero_stage=3)
    assert layout.shard_axes == ("dp_shard", "cp") and layout.shard_ranks == 8
    assert layout.grad_axes == ("dp_replicate", "dp_shard", "cp")
    plain = Layout(dp_shard=4, zero_stage=3)
    assert plain.shard_axes == ("dp_shard",) and plain.grad_axes == ("dp_replicate", "dp_shard")
    with pytest.raises(PlanError, match="dp_shard x cp, which is 1"):
        Layout(tp=2, zero_stage=3)


def test_interleaved_needs_virtual_stages():
    with pytest.raises(PlanError, match="virtual_stages"):
        Layout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=1)


def test_balanced_layers():
    assert balanced_layers(40, 4) == (10, 10, 10, 10)
    assert sum(balanced_layers(30, 4)) == 30
    assert balanced_layers(30, 4) == (7, 8, 8, 7)
    with pytest.raises(PlanError):
        balanced_layers(2, 4)


def test_fsdp_over_the_cp_ranks_alone_is_priced_and_sharded():
    """dp 1 x cp 8 under ZeRO-3 (torchtitan's FSDP 1 x CP 8): model state in eighths, FSDP collectives over the
    cp ranks, and meshplan's executor refuses only ZeRO-1 there (its ZeRO-1 shards over dp_shard)."""
    from planner.engines import executor_refusal
    from planner.memory.estimate import estimate_memory
    from planner.model.load import load_model
    from planner.simulate.step import simulate_step
    from planner.training import TrainingSpec
    from topologies.cluster_load import load_cluster

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", 8)
    training = TrainingSpec(seq_len=65536, global_batch_size=1)
    sharded = Layout(cp=8, zero_stage=3, recompute="full")
    whole = Layout(cp=8, zero_stage=0, recompute="full")
    over_dp = Layout(dp_shard=8, zero_stage=3, recompute="full", grad_accum_steps=1)
    for engine in ("torchtitan", "megatron", "meshplan"):
        states = [sum(estimate_memory(model, t, lay, cluster.gpu, engine).breakdown_bytes[k]
                      for k in ("params", "grads", "optimizer"))
                  for lay, t in ((sharded, training), (over_dp, training.replace(global_batch_size=8)), (whole, training))]
        assert states[0] == pytest.approx(states[1], rel=0.01) and states[0] < states[2] / 4, engine
    fsdp = simulate_step(model, training, sharded, cluster, engine="torchtitan").time_breakdown_s
    assert simulate_step(model, training, whole, cluster, engine="torchtitan").time_breakdown_s["fsdp_comm"] == 0
    assert fsdp["compute"] > 0 and "fsdp_comm" in fsdp
    assert executor_refusal(model, Layout(cp=8, zero_stage=3)) is None
    assert "ZeRO-1 over the cp ranks alone" in executor_refusal(model, Layout(cp=8, zero_stage=1))
