"""The simulator prices the schedule torch runs: every rank's operation order equals torch's `pipeline_order`.

`meshplan execute` runs torch.distributed.pipelining's Schedule1F1B,
ScheduleInterleaved1F1B and ScheduleZBVZeroBubble (executor.parallel.pipeline).
Each is built here for real, under the fake process group with tiny stages,
and the order it runs is compared with the order planner.simulate.pipeline
times: F as F, a full backward or an input-gradient pass (I) as B, a
weight-gradient pass as W.

The interleaved and zb-v schedules execute their `pipeline_order` (every
rank's actions, computed by every rank). Schedule1F1B does not: its
`_step_microbatches` loop runs min(n, pp - r) forwards, then alternates one
backward and one forward (its `pipeline_order` is only a description, and on
the last rank it numbers micro-batches from 1). So for 1f1b the loop itself
runs, one rank at a time, with the stage's compute and communication replaced
by a recorder.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from planner.layout import rank_chunks
from planner.memory.in_flight import in_flight_microbatches
from planner.simulate.pipeline import B, F, W, _compiled
from planner.simulate.v_orders import zbv_rank_order

_KINDS = {"F": F, "B": B, "I": B, "W": W}
_CLASSES = {"1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble}


def _torch_order(schedule: str, pp: int, v: int, n: int) -> dict[int, list[tuple[int, int, int]]]:
    """Every rank's compute actions in torch's pipeline_order, as (kind, chunk, micro-batch)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        group = dist.distributed_c10d._get_default_group()
        stages = [PipelineStage(nn.Linear(2, 2), s, pp * v, torch.device("cpu"), group=group)
                  for s in rank_chunks(schedule, pp, v, 0)]
        cls = _CLASSES[schedule]
        sched = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=n, loss_fn=nn.functional.mse_loss)
        return {r: [(_KINDS[a.computation_type.value], a.stage_index, a.microbatch_index)
                    for a in actions if a is not None and a.computation_type.value in _KINDS]
                for r, actions in sched.pipeline_order.items()}
    finally:
        dist.destroy_process_group()


def _torch_1f1b_runs(pp: int, n: int) -> dict[int, list[tuple[int, int, int]]]:
    """What Schedule1F1B's step loop computes on each rank, recorded instead of run."""
    out = {}
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            stage = PipelineStage(nn.Linear(2, 2), rank, pp, torch.device("cpu"), group=dist.group.WORLD)
            sched = Schedule1F1B(stage, n_microbatches=n, loss_fn=nn.functional.mse_loss)
            ran: list[tuple[int, int, int]] = []
            stage.forward_one_chunk = lambda mb, *a, ran=ran, r=rank, **k: ran.append((F, r, mb))
            stage.backward_one_chunk = lambda mb, *a, ran=ran, r=rank, **k: ran.append((B, r, mb))
            for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
                setattr(stage, name, lambda *a, **k: [])
            stage.perform_reduce_grad = lambda *a, **k: None
            for name in ("_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss", "_update_losses"):
                setattr(sched, name, lambda *a, **k: None)
            sched._check_inputs = lambda args, kwargs, *a: (args, kwargs)
            sched._step_microbatches([()] * n, [{}] * n, return_outputs=False)
            out[rank] = ran
        finally:
            dist.destroy_process_group()
    return out


def _our_order(schedule: str, pp: int, v: int, n: int) -> dict[int, list[tuple[int, int, int]]]:
    sched = _compiled(schedule, pp, v, n)
    out: dict[int, list[tuple[int, int, int]]] = {r: [] for r in range(pp)}
    for rank, kind, chunk, mb in zip(sched.rank.tolist(), sched.kind.tolist(), sched.chunk.tolist(),
                                     sched.micro_batch.tolist(), strict=True):
        out[rank].append((kind, chunk, mb))
    return out


CASES = [("1f1b", pp, 1, n) for pp, n in ((2, 2), (2, 4), (4, 4), (4, 8), (3, 7))] + \
    [("interleaved-1f1b", pp, v, n) for pp, v, n in ((2, 2, 4), (2, 2, 6), (4, 2, 8), (2, 3, 4), (4, 2, 16))] + \
    [("zb-v", pp, 2, n) for pp, n in ((2, 4), (2, 3), (2, 1), (3, 6), (4, 8), (4, 5), (4, 16))]


@pytest.mark.parametrize("schedule,pp,v,n", CASES)
def test_every_rank_runs_torchs_order(schedule, pp, v, n):
    torch_runs = _torch_1f1b_runs(pp, n) if schedule == "1f1b" else _torch_order(schedule, pp, v, n)
    assert _our_order(schedule, pp, v, n) == torch_runs


def test_zbv_rank0_runs_the_fourth_forward_before_the_first_input_gradient_and_w_after_its_b():
    """pp 2, 4 micro-batches: F(chunk 0, mb 3) before B(chunk 0, mb 0); outside the cool-down each W follows its B."""
    order = _our_order("zb-v", 2, 2, 4)[0]
    assert order.index((F, 0, 3)) < order.index((B, 0, 0))
    assert order[order.index((B, 3, 0)) + 1] == (W, 3, 0)
    assert order[order.index((B, 0, 0)) + 1] == (W, 0, 0)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zbv_memory_holds_what_the_order_keeps_alive(pp):
    """planner.memory's in-flight count for zb-v is the peak of live chunks in the order (F to W), per rank."""
    for n in (1, 2, 3, 4, 5, 2 * pp - 1, 2 * pp, 4 * pp + 1):
        for rank in range(pp):
            alive = peak = 0
            for kind, _, _ in zbv_rank_order(rank, pp, n):
                alive += {F: 1, W: -1}.get(kind, 0)
                peak = max(peak, alive)
            assert in_flight_microbatches("zb-v", pp, rank, n, 2) == peak / 2, (pp, n, rank)
