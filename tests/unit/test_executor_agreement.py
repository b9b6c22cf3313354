"""What the executor builds is what the planner priced: pipeline stages per rank and the data-parallel path.

Built in one process under the fake process group, once per claimed rank, on
the meta device (no memory, no communication): `executor.parallel.parallelize.shard`
runs for real. The plans are the determinism table's (tests/torchrun_util.py),
made by `meshplan plan` with the same pinned flags the multi-process test uses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchrun_util import DETERMINISM_LAYOUTS, TEST_DATA

from executor.model import build_model
from executor.parallel.mesh import build_mesh
from executor.parallel.parallelize import shard
from planner.cli.plan import plan as plan_command
from planner.engines import get_engine
from planner.layout import DP_AXES, rank_coords, stage_ranges
from planner.memory.params import pipeline_params
from planner.plan import load_plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plans")
    out = {}
    for name, (model, pinned) in DETERMINISM_LAYOUTS.items():
        path = tmp / f"{name}.json"
        res = CliRunner().invoke(plan_command, ["--model", model, "--cluster", "cpu", "--gpus", "4", *TEST_DATA,
                                                *pinned, "-o", str(path)])
        assert res.exit_code == 0, res.output
        out[name] = load_plan(path)
    return out


def _built(plan, rank):
    """(parts, stage ids, dp kind) that `rank` builds for `plan`, on meta under the fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan, "cpu")
        with torch.device("meta"):
            model = build_model(plan.model, torch.device("meta"))
        parts, stages, kind, _ = shard(model, plan, mesh, torch.float32)
        placements = set()
        for part in parts:
            for p in part.parameters():
                if isinstance(p, DTensor):
                    names = p.device_mesh.mesh_dim_names
                    placements |= {(n, type(pl).__name__) for n, pl in zip(names, p.placements, strict=True)
                                   if n in (*DP_AXES, "dp")}
                else:
                    placements.add(("plain", "Tensor"))
        return parts, stages, kind, placements
    finally:
        dist.destroy_process_group()


# What each planner dp path means on the parameters the executor builds.
_EXPECTED = {
    "none": lambda pl, lay: pl == {("plain", "Tensor")},  # no parameter carries a dp axis
    "ddp": lambda pl, lay: pl == {("plain", "Tensor")},  # DDP wraps plain tensors after initialization
    "replicate": lambda pl, lay: bool(pl) and all(kind == Replicate.__name__ for _, kind in pl),
    "fsdp": lambda pl, lay: (("dp_shard", Shard.__name__) in pl
                             and (("dp_replicate", Replicate.__name__) in pl) == (lay.dp_replicate > 1)),
}


@pytest.mark.parametrize("name", list(DETERMINISM_LAYOUTS))
def test_dp_kind_is_the_planners_dp_path(plans, name):
    plan = plans[name]
    planned = get_engine("meshplan").dp_path(plan.layout)
    _, _, kind, placements = _built(plan, 0)
    assert kind == planned
    assert _EXPECTED[planned](placements, plan.layout), (planned, placements)


@pytest.mark.parametrize("name", [n for n in DETERMINISM_LAYOUTS if "pp2" in n])
def test_stages_each_pp_rank_builds_are_the_planners(plans, name):
    """Stage ids, their layers and where the embedding and output live, per pipeline rank."""
    plan = plans[name]
    layout = plan.layout
    priced = pipeline_params(plan.model, layout, plan.engine)
    ranges = stage_ranges(layout.layers_per_stage)
    for rank in range(plan.world_size):
        pp_rank = rank_coords(layout.mesh_shape, rank)["pp"]
        parts, stages, _, _ = _built(plan, rank)
        assert tuple(stages) == layout.stages_of(pp_rank)
        held = [int(i) for part in parts for i in part.layers.keys()]
        assert held == [i for s in stages for i in ranges[s]]
        assert len(held) == priced[pp_rank].layers
        assert any(p.tok_embeddings is not None for p in parts) == priced[pp_rank].has_embedding
        assert any(p.output is not None for p in parts) == priced[pp_rank].has_output
