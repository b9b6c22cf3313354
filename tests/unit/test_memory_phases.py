"""The phases of a step (planner.memory.phases) against PyTorch's memory tracker.

Reference: torch.distributed._tools' FSDPMemTracker / MemTracker, run by the
harness behind `meshplan validate-memory` (executor.validate.memory_step:
one rank of the plan's full world, fake process group, FakeTensorMode, the
executor's own model, parallelization, clipping and AdamW) on a tiny Llama.
Each case is shaped so that a different moment of the step holds the most
memory, and the memory model must name that moment and land within 5% of the
tracker's peak (tensor bytes: `other` is 0 on both sides):

  backward_start   normal sequence and vocabulary: the loss backward's 12 B
                   per logit on top of every activation (also per-op SAC, context
                   parallel, and TP's vocabulary-parallel loss)
  output_backward  FSDP with 32 tokens: the head unit's reduction (its gathered
                   weights, all-gather buffer and reduce-scatter input)
  block_backward   small vocabulary: no big loss transient, so a block's
                   backward with its gathered units, reduce-scatter buffers
                   and (full recomputation) rebuilt activations is the most
  backward_end     FSDP with 32 tokens: the root unit's reduction (its
                   gathered weights, unsharded gradients, reduce-scatter input)
  optimizer_step   every model state at once, and nothing on top since AdamW
                   runs fused: no longer above backward_end, whose reduction
                   transient comes on top of the same states (DDP / ZeRO-1 /
                   one GPU with 32 tokens peak there)

Also expert parallelism (ep 2 over FSDP, balanced routing), context parallelism
(cp 2 with DDP, cp 2 x FSDP 4) and each stage of 2-stage pipelines: 1F1B, and
interleaved 1F1B with two chunks per rank (tiny, debug, debug-gpt), alone and
with data parallelism (1F1B x FSDP ZeRO-2/3, interleaved x 2 replicas).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.engines import ENGINE_NAMES as ENGINES
from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.memory.phases import PHASES
from planner.memory.states import model_state_bytes
from planner.model.load import load_model
from planner.model.spec import ModelSpec, MoESpec
from planner.plan import MEMORY_CATEGORIES, Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.hardware import get_gpu

TINY = ModelSpec(name="tiny", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64,
                 ffn_hidden=688, vocab=4096, max_seq_len=512)
H100 = get_gpu("h100-sxm")
TOLERANCE = 0.05

# name: (model changes, seq_len, micro-batch, GPUs, layout, the phase that must be the peak)
CASES = {
    "fsdp": ({}, 512, 2, 8, dict(dp_shard=8, zero_stage=3), "backward_start"),
    "zero1_ddp": ({}, 512, 2, 8, dict(dp_shard=8, zero_stage=1), "backward_start"),
    "tp_sp_fsdp": ({}, 512, 2, 8, dict(tp=2, dp_shard=4, zero_stage=3, sequence_parallel=True), "backward_start"),
    "fsdp_short": ({}, 32, 1, 8, dict(dp_shard=8, zero_stage=3), "output_backward"),
    "fsdp_op": ({}, 512, 2, 8, dict(dp_shard=8, zero_stage=3, recompute="op"), "backward_start"),
    "cp_fsdp": ({}, 512, 2, 8, dict(dp_shard=4, cp=2, zero_stage=3), "backward_start"),
    "fsdp_small_vocab": (dict(vocab=256), 256, 1, 8, dict(dp_shard=8, zero_stage=3), "block_backward"),
    "fsdp_full_recompute": (dict(vocab=256), 512, 2, 8, dict(dp_shard=8, zero_stage=3, recompute="full"),
                            "block_backward"),
    "zero1_full_recompute": (dict(vocab=256), 512, 2, 8, dict(dp_shard=8, zero_stage=1, recompute="full"),
                             "block_backward"),
    "replicate_full_recompute": (dict(vocab=256), 512, 2, 8, dict(tp=2, dp_replicate=4, recompute="full"),
                                 "block_backward"),
    "fsdp_tied_short": (dict(tie_embeddings=True), 32, 1, 8, dict(dp_shard=8, zero_stage=3), "backward_end"),
    "zero1_short": ({}, 32, 1, 8, dict(dp_shard=8, zero_stage=1), "backward_end"),
    "one_gpu_short": (dict(vocab=256), 32, 1, 1, {}, "backward_end"),
    # debug-moe's shape (4 experts, top 2, a shared expert) at the tiny model's width: experts outside
    # FSDP2, all_to_all over ep 2 with balanced routing (executor.validate.memory_step._balanced_routing)
    "cp_ddp": ({}, 512, 2, 2, dict(cp=2), "backward_start"),
    "ep_fsdp": (dict(moe=MoESpec(n_experts=4, top_k=2, expert_ffn_hidden=256, n_shared_experts=1)), 512, 2, 4,
                dict(dp_shard=4, ep=2, zero_stage=3), "backward_start"),
}


def _plan(changes: dict, seq_len: int, micro_batch: int, gpus: int, layout: dict) -> Plan:
    model = dataclasses.replace(TINY, **changes)
    lay = with_stage_layers(model, Layout(micro_batch_size=micro_batch, **layout))
    return Plan(model=model, cluster=load_cluster("dgx-h100", gpus),
                training=TrainingSpec(seq_len=seq_len, global_batch_size=micro_batch * lay.dp * lay.grad_accum_steps),
                layout=lay)


@pytest.mark.parametrize("name", CASES)
def test_peak_phase_and_bytes_match_torch_tracker(name):
    from executor.validate.memory_step import tracked_peak

    *shape, phase = CASES[name]
    plan = _plan(*shape)
    est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
    tracked = tracked_peak(plan, 0)["Total"]
    assert tracked > 1 << 20  # a real step, not an empty trace
    error = (est.allocated_bytes - tracked) / tracked  # tensors: the tracker has no caching allocator
    assert abs(error) <= TOLERANCE, f"{name}: predicted {est.allocated_bytes:,} vs tracked {tracked:,} ({error:+.1%})"
    assert est.peak_phase == phase


def _preset_plan(name: str, seq_len: int, micro_batch: int, layout: dict) -> Plan:
    model = load_model(name)
    lay = with_stage_layers(model, Layout(micro_batch_size=micro_batch, **layout))
    return Plan(model=model, cluster=load_cluster("dgx-h100", lay.world_size),
                training=TrainingSpec(seq_len=seq_len, global_batch_size=micro_batch * lay.dp * lay.grad_accum_steps),
                layout=lay)


INTERLEAVED = dict(pp=2, grad_accum_steps=4, pp_schedule="interleaved-1f1b", virtual_stages=2)
# name: the plan of a pp 2 pipeline, 4 micro-batches (one rank of each stage is tracked)
PIPELINES = {
    "1f1b": lambda: _plan({}, 512, 2, 2, dict(pp=2, grad_accum_steps=4)),
    "interleaved": lambda: _plan(dict(n_layers=4), 512, 2, 2, INTERLEAVED),
    "interleaved_debug": lambda: _preset_plan("debug", 256, 2, INTERLEAVED),
    "interleaved_debug_gpt": lambda: _preset_plan("debug-gpt", 256, 2, INTERLEAVED),  # tied across stages
    # data parallel stages: torch's stages accumulate unsharded gradients and reduce after the last backward
    "1f1b_fsdp": lambda: _plan({}, 512, 2, 4, dict(pp=2, dp_shard=2, zero_stage=3, grad_accum_steps=4)),
    "1f1b_zero2": lambda: _plan({}, 512, 2, 4, dict(pp=2, dp_shard=2, zero_stage=2, grad_accum_steps=4)),
    "interleaved_replicas": lambda: _plan(dict(n_layers=4), 512, 2, 4, dict(INTERLEAVED, dp_replicate=2)),
    "interleaved_debug_replicas": lambda: _preset_plan("debug", 256, 2, dict(INTERLEAVED, dp_replicate=2)),
}


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_stages_match_torch_tracker(name, stage):
    """Each pipeline rank's stages, run in torch's schedule order by the harness (executor.validate.memory_pipeline:
    Schedule1F1B's loop, ScheduleInterleaved1F1B's pipeline_order), against the memory model's figure for that rank."""
    from executor.validate.memory_step import tracked_peak

    plan = PIPELINES[name]()
    est = estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine, 0)
    predicted = sum(v for k, v in est.per_stage[stage].items() if k != "other")  # tensors: no allocator
    rank = stage * plan.world_size // plan.layout.pp  # the stage's first rank
    tracked = tracked_peak(plan, rank)["Total"]
    error = (predicted - tracked) / tracked
    assert abs(error) <= TOLERANCE, f"{name} stage {stage}: predicted {predicted:,} vs tracked {tracked:,} ({error:+.1%})"


def test_pipeline_orders_are_torchs():
    """The harness's 1F1B order is Schedule1F1B's loop; its interleaved order is read from the executor's own
    ScheduleInterleaved1F1B: the last rank runs each last-stage forward right before that micro-batch's
    backward (one micro-batch of logits at a time), and rank 0's live stage-0 micro-batches peak where the
    memory model's first_stage_alive says."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executor.validate.memory_pipeline import order_1f1b, rank_order
    from planner.memory.in_flight import first_stage_alive

    assert order_1f1b(0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    for pp, n in ((2, 4), (2, 8), (4, 8), (4, 16), (2, 3), (4, 6)):  # the last two: rounds of n, not pp
        layout = Layout(pp=pp, grad_accum_steps=n, pp_schedule="interleaved-1f1b", virtual_stages=2)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
        try:
            orders = {r: rank_order(layout, r, dist.group.WORLD) for r in (0, pp - 1)}
        finally:
            dist.destroy_process_group()
        last = 2 * pp - 1
        ops = orders[pp - 1]
        assert sum(op == "F" for op, _, _ in ops) == sum(op == "B" for op, _, _ in ops) == 2 * n
        for k, (op, stage, i) in enumerate(ops):
            if op == "F" and stage == last:
                assert ops[k + 1] == ("B", last, i)
        alive: dict[int, set] = {0: set(), pp: set()}
        best = (0, 0)
        for op, stage, i in orders[0]:
            (alive[stage].add if op == "F" else alive[stage].discard)(i)
            best = max(best, (len(alive[0]) + len(alive[pp]), len(alive[0])))
        assert first_stage_alive("interleaved-1f1b", pp, n, 2) == best[1], (pp, n)


@pytest.mark.parametrize("n", [1, 4, 8])
def test_torch_stages_keep_a_receive_buffer_per_micro_batch(n):
    """What planner.memory.boundary assumes of torch 2.13: a PipelineStage set up for n micro-batches holds n
    distinct input buffers (not the first stage) and n output-gradient buffers (not the last); a middle stage
    with no live micro-batch therefore holds 2n boundary tensors, the first n + its live ones, the last n - 1."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import InferenceMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.memory.boundary import boundary_buffers

    x = torch.empty(2, 8, 4, requires_grad=True)
    held = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        for stage_index in range(3):
            stage = PipelineStage(nn.Identity(), stage_index, 3, torch.device("cpu"), input_args=x, output_args=x,
                                  group=dist.group.WORLD)
            stage._inference_mode = InferenceMode.STATIC  # shapes given: no exchange between stages
            stage._prepare_forward_infra(n, (x,) if stage_index == 0 else None, has_backward=True)
            stage._prepare_backward_infra(n)
            infos = [i for r in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()) for i in r]
            held[stage_index] = len({i.buffer.data_ptr() for i in infos if i.buffer is not None})
    finally:
        dist.destroy_process_group()
    assert held == {0: n, 1: 2 * n, 2: n}
    assert boundary_buffers("1f1b", 3, n, 1, first=False, last=False, first_alive=0) == held[1]
    assert boundary_buffers("1f1b", 3, n, 1, first=True, last=False, first_alive=2) == held[0] + 2
    assert boundary_buffers("1f1b", 3, n, 1, first=False, last=True, first_alive=0) == held[2] - 1


def test_fsdp_accumulation_keeps_only_sharded_gradients():
    """The executor reduce-scatters every micro-batch under FSDP2 (torchtitan's way): between micro-batches
    only the sharded fp32 gradients stay, 4/N B per parameter, never the unsharded 4 B."""
    m = load_model("llama3.2-1b")
    training = TrainingSpec(seq_len=2048, global_batch_size=128)
    one = estimate_memory(m, training, Layout(dp_shard=64, zero_stage=3), H100, other_bytes=0)
    two = estimate_memory(m, training, Layout(dp_shard=64, zero_stage=3, grad_accum_steps=2), H100, other_bytes=0)
    assert one.peak_phase == two.peak_phase == "backward_start"
    sharded = two.breakdown_bytes["grads"]
    assert 0 < sharded < 4 * m.total_params / 60
    assert two.allocated_bytes - one.allocated_bytes == sharded


def test_breakdown_is_the_peak_phase():
    m = load_model("llama2-13b")
    training = TrainingSpec(seq_len=4096, global_batch_size=256)
    e = estimate_memory(m, training, Layout(pp=4, tp=2, dp_shard=2, zero_stage=3, grad_accum_steps=8), H100)
    assert set(e.phases) <= set(PHASES) and e.peak_phase in e.phases
    assert e.breakdown_bytes == e.phases[e.peak_phase] == e.per_stage[e.worst_stage]
    assert e.peak_bytes == sum(e.breakdown_bytes.values()) == max(sum(b.values()) for b in e.phases.values())
    assert all(tuple(b) == MEMORY_CATEGORIES for b in e.phases.values())
    assert e.peak_bytes == max(sum(s.values()) for s in e.per_stage)
    j = e.to_json()
    assert j["peak_phase"] == e.peak_phase and j["phase_peak_bytes"][e.peak_phase] == e.peak_bytes


LAYOUT = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4]),
    "pp": st.sampled_from([1, 2, 4]),
    "dp": st.sampled_from([1, 2, 8]),
    "zero": st.sampled_from([0, 1, 2, 3]),
    "hsdp": st.booleans(),
    "schedule": st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zb-v"]),
    "micro_batch": st.sampled_from([1, 2]),
    "accum": st.sampled_from([1, 4]),
    "recompute": st.sampled_from(["none", "selective", "full"]),
    "offload": st.sampled_from(["none", "optimizer", "optimizer+params"]),
})


@settings(max_examples=150, deadline=None)
@given(LAYOUT, st.sampled_from(ENGINES),
       st.sampled_from(["llama3.2-1b", "llama2-7b", "debug-gpt", "mixtral-8x7b"]), st.sampled_from(["bf16", "fp32"]))
def test_peak_never_below_model_states(o, engine, name, dtype):
    """The search prunes a shape when model_state_bytes + other does not fit: that must be a lower bound."""
    m = load_model(name)
    accum = max(o["accum"], o["pp"]) if o["pp"] > 1 else o["accum"]
    v = {"interleaved-1f1b": 2, "zb-v": 2}.get(o["schedule"], 1) if o["pp"] > 1 else 1
    assume(m.n_layers >= o["pp"] * v and m.n_kv_heads % o["tp"] == 0)
    if o["zero"] == 0:
        dp = dict(dp_replicate=o["dp"])
    else:
        dp = dict(dp_replicate=2, dp_shard=o["dp"] // 2) if o["hsdp"] else dict(dp_shard=o["dp"])
        assume(dp["dp_shard"] > 1)
    layout = Layout(tp=o["tp"], pp=o["pp"], zero_stage=o["zero"], micro_batch_size=o["micro_batch"],
                    grad_accum_steps=accum, recompute=o["recompute"], offload=o["offload"],
                    pp_schedule=o["schedule"] if o["pp"] > 1 else "1f1b", virtual_stages=v, **dp)
    training = TrainingSpec(seq_len=1024, global_batch_size=64, dtype=dtype)
    e = estimate_memory(m, training, layout, H100, engine)
    assert e.peak_bytes >= model_state_bytes(m, training, layout, engine) + e.breakdown_bytes["other"]
    assert min(min(b.values()) for b in e.phases.values()) >= 0
