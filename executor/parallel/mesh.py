"""The device mesh of a plan: process groups in rank-grid order, and the device each rank uses.

`init_device_mesh(device, shape, mesh_dim_names=MESH_AXES)` lays ranks out
row-major over (pp, dp_replicate, dp_shard, cp, tp), tp fastest: exactly the
grid of `planner.layout.axis_groups`, so the groups the simulator priced are
the groups that run (tests/test_executor_mesh.py checks both agree). Size-1
axes are kept so every rank can name every axis. One flattened axis is added:
"dp" = (dp_replicate, dp_shard), the group that averages gradients.

Device and backend: a plan for GPUs runs on cuda:LOCAL_RANK with NCCL; a plan
for the `cpu` cluster runs CPU ranks on gloo.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.layout import DP_AXES, MESH_AXES
from planner.plan import Plan


def device_type_for(plan: Plan) -> str:
    """'cuda' for a GPU plan, 'cpu' for the cpu cluster's ranks."""
    return "cpu" if plan.cluster.gpu.kind == "cpu" else "cuda"


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def local_device(device_type: str) -> torch.device:
    """cuda:LOCAL_RANK (and make it current) or cpu."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The 5-D mesh of the plan (plus the flattened "dp" axis). The process group must exist."""
    mesh = init_device_mesh(device_type, plan.layout.mesh_shape, mesh_dim_names=MESH_AXES)
    dp_flat(mesh)
    return mesh


def dp_flat(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened data-parallel axis (dp_replicate x dp_shard), whose group averages gradients.

    Created once and cached by DeviceMesh; asking again returns the same mesh.
    """
    return mesh[DP_AXES]._flatten("dp")


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index along the flattened dp axis: which slice of the global batch it reads."""
    return dp_flat(mesh).get_local_rank()
