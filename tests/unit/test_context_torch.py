"""torch's context_parallel (all-gather rotate method) as planner.simulate.context prices it."""

from __future__ import annotations

import dataclasses

import pytest

from planner.engines import ContextParallel, get_engine
from planner.layout import Layout
from planner.model.load import load_model
from planner.simulate.calibration import load_calibration
from planner.simulate.compute import memory_time_s
from planner.simulate.context import (
    KV_COPY_BYTES,
    MERGE_CASTS_BYTES,
    MERGE_STEP_BYTES,
    sdpa_kv_width,
    torch_cp_cost,
)
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError
from topologies.hardware import get_gpu

MODEL = load_model("llama3-8b")
GPU = get_gpu("h100-sxm")
CAL = load_calibration(None, GPU).for_engine("torchtitan")
SEQ = 65536


class FixedComm:
    """A StepComm stand-in whose all-gather and send/recv take fixed times."""

    def __init__(self, gather_s: float, send_s: float):
        self.gather_s, self.send_s = gather_s, send_s
        self.asked: list[tuple[str, float]] = []

    def time_s(self, op: str, size_bytes: float, axes: tuple[str, ...]) -> float:
        self.asked.append((op, size_bytes))
        return self.gather_s

    def pair_time_s(self, size_bytes: float, axes: tuple[str, ...], a: int, b: int) -> float:
        self.asked.append(("send_recv", size_bytes))
        return self.send_s


def cost(cp: int, comm: FixedComm, core_f: float = 0.1, core_b: float = 0.25, recompute: str = "full",
         repeats_kv: bool = True, compile: bool = False):
    layout = Layout(cp=cp, dp_shard=8 // cp, zero_stage=3, micro_batch_size=1, grad_accum_steps=1,
                    recompute=recompute)
    return torch_cp_cost(MODEL, SEQ, 2, layout, comm, GPU, CAL, core_f, core_b, repeats_kv=repeats_kv,
                         compile=compile)


def test_no_context_parallel_costs_nothing():
    comm = FixedComm(1.0, 1.0)
    assert cost(1, comm) == cost(1, comm).__class__(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    assert comm.asked == []


def test_gather_hides_under_the_first_sdpa_call_only():
    # 40 ms of gather under a 100 ms forward core: a ring would hide it all; cp 4 hides 25 ms of it
    c = cost(4, FixedComm(gather_s=0.040, send_s=0.0))
    assert c.comm_f == pytest.approx(0.040 - 0.100 / 4)
    assert cost(2, FixedComm(gather_s=0.040, send_s=0.0)).comm_f == 0.0  # 50 ms hides it at cp 2


def test_last_gradient_send_is_always_exposed():
    c = cost(4, FixedComm(gather_s=0.0, send_s=0.010), core_b=100.0, recompute="op")
    assert c.comm_b == pytest.approx(0.010)
    slow = cost(4, FixedComm(gather_s=0.0, send_s=0.200), core_b=0.4, recompute="op")
    assert slow.comm_b == pytest.approx(3 * (0.200 - 0.4 / 4) + 0.200)


def test_gradients_travel_in_fp32_and_kv_at_the_query_width():
    comm = FixedComm(0.0, 0.0)
    cost(4, comm)
    local = SEQ / 4 * MODEL.n_heads * MODEL.head_dim  # repeat_kv: K (and V) as wide as the queries
    assert ("all_gather", 4 * 2 * local * 2) in comm.asked
    assert ("send_recv", 2 * local * 4) in comm.asked
    narrow = FixedComm(0.0, 0.0)
    cost(4, narrow, repeats_kv=False)
    assert ("all_gather", 4 * 2 * local / 4 * 2) in narrow.asked  # llama3-8b: 8 of 32 heads carry K/V


def test_kv_width_follows_the_heads_sdpa_receives():
    assert sdpa_kv_width(MODEL, 2, repeats_kv=True) == MODEL.n_heads * MODEL.head_dim / 2
    assert sdpa_kv_width(MODEL, 2, repeats_kv=False) == MODEL.kv_dim / 2


def test_merge_passes_grow_with_the_steps_and_compile_fuses_them():
    comm = FixedComm(0.0, 0.0)
    two, eight = cost(2, comm), cost(8, comm)
    out = SEQ / 8 * MODEL.q_dim  # cp 8's rank: its merges alone are a floor of its forward passes
    assert eight.forward_s > memory_time_s(out * (MERGE_CASTS_BYTES + 7 * MERGE_STEP_BYTES), GPU, CAL)
    per_token_two, per_token_eight = two.forward_s / (SEQ / 2), eight.forward_s / (SEQ / 8)
    assert per_token_eight > 3 * per_token_two  # 7 merge steps against 1
    compiled = cost(8, comm, compile=True).forward_s
    assert compiled < eight.forward_s / 2  # fused, and the six unused K/V concatenations dropped
    kv = SEQ / 8 * MODEL.n_heads * MODEL.head_dim
    unused = 6 * 2 * kv * KV_COPY_BYTES
    assert compiled == pytest.approx((eight.forward_s - memory_time_s(unused, GPU, CAL)) / 2)
    assert eight.backward_s > eight.forward_s  # fp32 dQ, dK, dV accumulators and send buffers


def test_full_recompute_runs_the_gather_and_merges_again():
    comm = FixedComm(gather_s=0.040, send_s=0.0)
    full, op = cost(4, comm, recompute="full"), cost(4, comm, recompute="op")
    assert full.recompute_s == pytest.approx(full.forward_s) and op.recompute_s == 0.0
    assert full.comm_b - op.comm_b == pytest.approx(full.comm_f)


def test_unknown_rotate_method_is_refused():
    with pytest.raises(PlanError, match="rotate"):
        ContextParallel("custom", rotate="alltoall-ring", gathers_kv=True)


def test_torchtitan_all_gather_costs_more_than_the_ring_and_nothing_without_cp():
    training = TrainingSpec(seq_len=SEQ, global_batch_size=2, precision="bf16")
    cluster = load_cluster("dgx-h100", 16)
    titan = get_engine("torchtitan@2024-12")
    ring = dataclasses.replace(titan, context_parallel=dataclasses.replace(titan.context_parallel, rotate="ring"))
    assert titan.context_parallel.rotate == "allgather" and get_engine("megatron").context_parallel.rotate == "ring"
    cp = Layout(cp=8, dp_shard=2, zero_stage=3, micro_batch_size=1, grad_accum_steps=1, recompute="full")
    gathered = simulate_step(MODEL, training, cp, cluster, engine=titan)
    ringed = simulate_step(MODEL, training, cp, cluster, engine=ring)
    assert gathered.step_time_s > ringed.step_time_s
    assert gathered.time_breakdown_s["cp_comm"] > 0.0  # at least the last fp32 dK/dV send
    flat = Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, grad_accum_steps=1, recompute="full")
    assert simulate_step(MODEL, training, flat, cluster, engine=titan).step_time_s == \
        simulate_step(MODEL, training, flat, cluster, engine=ring).step_time_s
