"""DualPipeV: the order torch runs, its bubble and memory, its bound, and who runs it.

planner.simulate.pipeline times DualPipeV in the order deepseek-ai/DualPipe's
DualPipeV.step and torch's ScheduleDualPipeV run: every rank's order is
compared here with the one torch builds (`_calculate_single_rank_operations`,
built for real under the fake process group), an overlapped forward-backward
action as FO, BO and the W of its full backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
from torch.distributed.pipelining.schedules import _ComputationType
from torch.testing._internal.distributed.fake_pg import FakeStore

from planner.engines import get_engine
from planner.layout import Layout, rank_chunks
from planner.memory.in_flight import in_flight_microbatches
from planner.model.load import load_model
from planner.plan import with_stage_layers
from planner.search.bound import StepBound
from planner.search.candidates import Pins
from planner.search.search import search
from planner.simulate.calibration import load_calibration
from planner.simulate.pipeline import BO, FO, B, F, W, simulate_pipeline
from planner.simulate.step import simulate_step
from planner.simulate.v_orders import dualpipev_rank_order
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError

_SINGLE = {_ComputationType.FORWARD: (F,), _ComputationType.BACKWARD_INPUT: (B,),
           _ComputationType.BACKWARD_WEIGHT: (W,), _ComputationType.FULL_BACKWARD: (B, W)}


def _torch_orders(pp: int, n: int) -> dict[int, list[tuple[int, int, int]]]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        group = dist.distributed_c10d._get_default_group()
        stages = [PipelineStage(nn.Linear(2, 2), s, 2 * pp, torch.device("cpu"), group=group)
                  for s in rank_chunks("dualpipev", pp, 2, 0)]
        sched = ScheduleDualPipeV(stages, n_microbatches=n, loss_fn=nn.functional.mse_loss)
        out = {}
        for rank in range(pp):
            ops = []
            for a in sched._calculate_single_rank_operations(rank):
                if a.computation_type == _ComputationType.OVERLAP_F_B:
                    f, b = a.sub_actions
                    ops += [(FO, f.stage_index, f.microbatch_index), (BO, b.stage_index, b.microbatch_index),
                            (W, b.stage_index, b.microbatch_index)]
                else:
                    ops += [(k, a.stage_index, a.microbatch_index) for k in _SINGLE[a.computation_type]]
            out[rank] = ops
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_every_rank_runs_torchs_dualpipev_order(pp):
    for n in (2 * pp, 2 * pp + 1, 2 * pp + 5):
        torch_orders = _torch_orders(pp, n)
        for rank in range(pp):
            assert dualpipev_rank_order(rank, pp, n) == torch_orders[rank], (pp, n, rank)


def test_bubble_is_the_references_formula():
    """Equal chunk passes and no transfers, the case the reference's table states (deepseek-ai/DualPipe README):
    every rank idles (PP/2 - 1)(F&B + B - 3W) for PP = 2 pp stages, F&B the overlapped pair (FO + BO + its W).
    Other costs give other bubbles: the simulator measures them (module docstring), it does not assume the table."""
    for unit in (1.0, 0.25):
        for pp, n in ((2, 4), (4, 8), (4, 13), (8, 20)):
            run = simulate_pipeline("dualpipev", pp, 2, n, [[unit] * 2 * pp] * 5, [0.0] * 2 * pp)
            fb = 3 * unit
            for rank in range(pp):
                idle = run.rank_end_s[rank] - run.rank_busy_s[rank]
                assert idle == pytest.approx((2 * pp / 2 - 1) * (fb + unit - 3 * unit)), (pp, n, rank)


def test_dualpipev_needs_two_micro_batches_per_stage_pair():
    with pytest.raises(PlanError, match="2 x pp"):
        simulate_pipeline("dualpipev", 4, 2, 7, [[1.0] * 8] * 5, [0.0] * 8)


def test_activations_are_pp_plus_one_stages():
    """The reference's PP + 1 stages of activations, PP = 2 pp: (2 pp + 1) / 2 micro-batches of a rank's layers,
    which is what the order keeps alive between a chunk's forward and its W (counted here)."""
    for pp, n in ((2, 4), (4, 9), (8, 16)):
        for rank in range(pp):
            alive = peak = 0
            for kind, _, _ in dualpipev_rank_order(rank, pp, n):
                alive += 1 if kind in (F, FO) else -1 if kind == W else 0
                peak = max(peak, alive)
            assert in_flight_microbatches("dualpipev", pp, rank, n, 2) == peak / 2 == (2 * pp + 1) / 2


def test_overlap_hides_the_expert_all_to_alls_and_the_bound_holds():
    """Same MoE layout: DualPipeV's F&B pairs hide expert all-to-alls ZB-V exposes, the breakdown still sums to the
    step, and the search's bound stays below the simulated step."""
    model, cluster = load_model("mixtral-8x7b"), load_cluster("dgx-h100", 64)
    bound = StepBound(model, cluster, load_calibration(None, cluster.gpu), "torchtitan")
    steps = {}
    for schedule in ("zb-v", "dualpipev"):
        layout = with_stage_layers(model, Layout(pp=4, dp_shard=16, ep=8, zero_stage=2, pp_schedule=schedule,
                                                 virtual_stages=2, micro_batch_size=1, grad_accum_steps=16))
        training = TrainingSpec(4096, 16 * 16)
        result = simulate_step(model, training, layout, cluster, engine="torchtitan")
        parts = {k: v for k, v in result.time_breakdown_s.items() if k != "exposed_comm"}
        assert sum(parts.values()) == pytest.approx(result.step_time_s)
        assert bound.seconds(layout, training) <= result.step_time_s
        steps[schedule] = result
    assert steps["dualpipev"].time_breakdown_s["ep_comm"] < 0.5 * steps["zb-v"].time_breakdown_s["ep_comm"]
    assert steps["dualpipev"].step_time_s < steps["zb-v"].step_time_s
    assert steps["dualpipev"].memory.peak_bytes > steps["zb-v"].memory.peak_bytes  # 2 pp + 1 chunks in flight


def test_who_runs_it():
    """torchtitan from the release that has torch's ScheduleDualPipeV; meshplan's executor refuses it by name;
    Megatron-Core and DeepSpeed have no such schedule."""
    model = load_model("mixtral-8x7b")
    layout = Layout(pp=4, dp_shard=16, ep=8, zero_stage=2, pp_schedule="dualpipev", virtual_stages=2)
    assert get_engine("torchtitan").refusal(model, layout, "bf16", True) is None
    assert "dualpipev" in get_engine("torchtitan@2025-10").pp_schedules
    assert "dualpipev" not in get_engine("torchtitan@2025-06").pp_schedules
    assert "DualPipeV" in get_engine("meshplan").refusal(load_model("8B"), layout.replace(ep=1), "bf16", True)
    for name in ("megatron", "deepspeed"):
        assert "dualpipev" in get_engine(name).refusal(model, layout, "bf16", True)


def test_the_search_proposes_it_only_for_engines_that_run_it():
    model, cluster = load_model("mixtral-8x7b"), load_cluster("dgx-h100", 64)
    pins = Pins(pp=4, pp_schedule="dualpipev")
    found = search(model, cluster, 4096, 2048, pins=pins, engine="torchtitan", top_k=3)
    assert found.ranked and all(s.layout.pp_schedule == "dualpipev" for s in found.ranked)
    assert all(s.layout.grad_accum_steps >= 8 for s in found.ranked)
    refused = search(model, cluster, 4096, 2048, pins=pins, engine="megatron", top_k=3)
    assert not refused.ranked and "dualpipev" in refused.stats.unsupported_reason


def test_deepseek_v3_production_row_runs_dualpipev():
    """bench/rows/production/deepseek-v3-2048-h800.json (2,048 H800, PP 16 x EP 64, DualPipe) goes through
    `meshplan simulate`'s path with its DualPipeV schedule, and stated with ZB-V instead (the same V placement
    without the overlapped passes) it is predicted slower: the overlap is what the schedule adds."""
    import dataclasses
    from pathlib import Path

    from planner.cli.row import load_row, simulate_row

    row = load_row(Path(__file__).resolve().parents[2] / "bench" / "rows" / "production" / "deepseek-v3-2048-h800.json")
    assert row.plan.layout.pp_schedule == "dualpipev" and row.plan.layout.pp == 16 and row.plan.layout.ep == 64
    flags = list(row.flags)
    flags[flags.index("dualpipev")] = "zb-v"
    zbv_row = dataclasses.replace(row, id=row.id + "-zbv", flags=tuple(flags))
    assert zbv_row.plan.layout.pp_schedule == "zb-v"
    assert simulate_row(row).step_time_s < simulate_row(zbv_row).step_time_s


def test_torchtitan_export_names_torchs_schedule():
    """The torchtitan export writes pipeline_parallel_schedule by the names torch's get_schedule_class knows."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from planner.export.torchtitan import SCHEDULES

    assert get_schedule_class(SCHEDULES["dualpipev"]) is ScheduleDualPipeV
