"""The executor's device mesh groups exactly the ranks the planner's rank grid says.

Built in one process under the fake process group, once per claimed rank:
init_device_mesh runs for real, and each axis's group (the ranks that
communicate along it) is compared with planner.layout.axis_groups, the
function the simulator prices.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from executor.parallel.mesh import build_mesh, dp_flat, dp_rank
from planner.layout import MESH_AXES, Layout, axis_groups
from planner.model.load import load_model
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster

SHAPES = [
    dict(tp=2, dp_shard=2, zero_stage=3, micro_batch_size=2),
    dict(pp=2, dp_replicate=2, tp=2, micro_batch_size=1, grad_accum_steps=2),
    dict(pp=2, dp_replicate=2, dp_shard=2, zero_stage=3, micro_batch_size=1, grad_accum_steps=2),
]


def _plan(**kw) -> Plan:
    spec = load_model("debug")
    layout = with_stage_layers(spec, Layout(**kw))
    return Plan(model=spec, cluster=load_cluster("cpu", layout.world_size),
                training=TrainingSpec(seq_len=64, dtype="fp32", global_batch_size=layout.dp * layout.micro_batch_size
                                      * layout.grad_accum_steps), layout=layout)


@pytest.mark.parametrize("kw", SHAPES)
def test_mesh_groups_equal_rank_grid(kw):
    plan = _plan(**kw)
    shape = plan.layout.mesh_shape
    for rank in range(plan.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
        try:
            mesh = build_mesh(plan, "cpu")
            for axis in MESH_AXES:
                mine = [g for g in axis_groups(shape, (axis,)) if rank in g]
                assert mesh[axis].mesh.flatten().tolist() == list(mine[0]), (axis, rank)
            dp_group = [g for g in axis_groups(shape, ("dp_replicate", "dp_shard")) if rank in g][0]
            assert dp_flat(mesh).mesh.flatten().tolist() == list(dp_group)
            assert dp_rank(mesh) == dp_group.index(rank)
        finally:
            dist.destroy_process_group()
