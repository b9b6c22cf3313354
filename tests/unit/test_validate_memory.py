"""`meshplan validate-memory`: the memory model within 10% of PyTorch's own tracker.

A ~100M-parameter Llama-style model (8 layers, hidden 768, GQA 12/4 heads,
32k vocabulary) on 16 H100s in bf16, one rank of the full world built by the
executor under a fake process group and FakeTensorMode. The reference is
torch.distributed._tools' FSDPMemTracker / MemTracker, never our own numbers;
the 1B-on-64-GPU figures come from bench/validate_memory_1b.py.
If a case fails, the memory model (planner/memory/estimate.py) is what to fix.
"""

from __future__ import annotations

import pytest

from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster

SPEC = ModelSpec(name="llama-100m", n_layers=8, hidden=768, n_heads=12, n_kv_heads=4, head_dim=64,
                 ffn_hidden=2048, vocab=32000, max_seq_len=1024)
GPUS = 16


def _plan_file(tmp_path, **layout) -> str:
    lay = with_stage_layers(SPEC, Layout(micro_batch_size=2, **layout))
    plan = Plan(model=SPEC, cluster=load_cluster("dgx-h100", GPUS),
                training=TrainingSpec(seq_len=1024, global_batch_size=2 * lay.dp * lay.grad_accum_steps),
                layout=lay)
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


LAYOUTS = {
    "fsdp": dict(dp_shard=16, zero_stage=3),
    "hsdp": dict(dp_replicate=4, dp_shard=4, zero_stage=3),
    "tp_x_fsdp": dict(tp=2, dp_shard=8, zero_stage=3),
    "zero1": dict(dp_shard=16, zero_stage=1),
    # two micro-batches: the trackers must survive a module's second forward in one step
    "fsdp_accum2": dict(dp_shard=16, zero_stage=3, grad_accum_steps=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_peak_within_10_percent_of_torch_tracker(cli, tmp_path, name):
    r = cli("validate-memory", _plan_file(tmp_path, **LAYOUTS[name]), "--json", timeout=300)
    assert r.code == 0, r.stderr
    doc = r.json()
    assert {"predicted_peak_bytes", "tracked_peak_bytes", "by_category"} <= set(doc)
    tracked = doc["tracked_peak_bytes"]
    assert tracked > 500 * 2**20  # a real step of a 100M model at 2 x 1024 tokens, not an empty trace
    # the categories partition the tracker's peak: nothing dropped, nothing counted twice
    assert sum(c["tracked"] for c in doc["by_category"].values()) == tracked
    error = (doc["predicted_peak_bytes"] - tracked) / tracked
    assert abs(error) <= 0.10, f"{name}: predicted {doc['predicted_peak_bytes']:,} vs tracked {tracked:,} ({error:+.1%})"


@pytest.mark.slow
def test_fsdp_shards_and_bf16_copies_are_what_torch_allocates(cli, tmp_path):
    """Checks on the harness itself, from first principles rather than the memory model.

    ZeRO-3 over 16 ranks: AdamW keeps 2 fp32 moments of this rank's 1/16
    shard (FSDP2 pads each parameter's dim 0 to a multiple of 16, hence the
    slack). ZeRO-2 keeps every unit's bf16 compute copy from forward to
    backward: 2 bytes per parameter, proof the GPU plan ran in bf16 on CPU.
    """
    shard = SPEC.total_params / GPUS
    r3 = cli("validate-memory", _plan_file(tmp_path, dp_shard=16, zero_stage=3), "--json", timeout=300)
    assert r3.code == 0, r3.stderr
    optimizer = r3.json()["by_category"]["optimizer"]["tracked"]
    assert 8 * shard <= optimizer <= 8 * shard * 1.01
    r2 = cli("validate-memory", _plan_file(tmp_path, dp_shard=16, zero_stage=2), "--json", timeout=300)
    assert r2.code == 0, r2.stderr
    unsharded = r2.json()["ranks"][0]["tracker_categories"]["Unsharded Param"]
    assert 2 * SPEC.total_params <= unsharded <= 2 * SPEC.total_params * 1.01


def test_pipeline_plans_the_harness_cannot_replay_are_refused_with_the_reason(cli, tmp_path):
    """1F1B and interleaved 1F1B pipelines run (tests/unit/test_memory_phases.py), but not interleaved under
    FSDP (PyTorch's FSDPMemTracker follows one FSDP root; the rank holds two stages), nor with TP."""
    r = cli("validate-memory", _plan_file(tmp_path, pp=2, dp_shard=8, zero_stage=3, grad_accum_steps=2,
                                          pp_schedule="interleaved-1f1b", virtual_stages=2))
    assert r.code == 2 and "FSDPMemTracker" in r.stderr and "Traceback" not in r.stderr
    r = cli("validate-memory", _plan_file(tmp_path, pp=2, tp=2, dp_shard=4, zero_stage=3, grad_accum_steps=2))
    assert r.code == 2 and "tensor parallelism (tp 2)" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_human_table_for_a_chosen_rank(cli, tmp_path):
    plan = _plan_file(tmp_path, tp=2, dp_shard=8, zero_stage=3)
    r = cli("validate-memory", plan, "--rank", "15", timeout=300)
    assert r.code == 0, r.stderr
    text = " ".join(r.stdout.split())  # rich wraps long lines
    assert "rank 15 (stage 0) of 16" in text and "activations" in text and "10% of PyTorch's tracker" in text
    bad = cli("validate-memory", plan, "--rank", "16")
    assert bad.code == 2 and "outside the plan's world of 16" in bad.stderr


def test_tracker_categories_map_onto_plan_categories():
    from executor.validate.memory import tracked_categories

    raw = {"Sharded Param": 1, "Unsharded Param": 10, "Buffer": 100, "Sharded Grad": 1000, "Unsharded Grad": 10**4,
           "Activation": 10**5, "Temp": 10**6, "All Gather": 10**7, "Reduce Scatter": 10**8, "OptState": 10**9,
           "Inputs": 10**10, "Total": 11111111111}
    z3 = tracked_categories(raw, zero_stage=3)
    assert z3 == {"params": 101, "grads": 1000, "optimizer": 10**9, "activations": 10**10 + 10**6 + 10**5,
                  "comm_buffers": 10**8 + 10**7 + 10**4 + 10}
    assert tracked_categories(raw, zero_stage=2)["params"] == 111  # the ZeRO-2 compute copy is "params"


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_untied_8b_tp4_fsdp16_within_5_percent(sequence_parallel):
    """Llama 3 8B (untied: vocabulary-parallel loss under TP) at TP 4 x FSDP 16, rank 0 of a 64-rank world.

    Its peak is the loss backward, where DTensor's loss_parallel holds 16 B per local logit; measured
    -0.0% in both cases (it read -12% and -13% while the harness counted DTensor's global-shape sharding
    propagation as memory, and the memory model had been fitted to that at tp 2).
    """
    from executor.validate.memory import validate_plan
    from planner.model.load import load_model

    model = load_model("llama3-8b")
    lay = with_stage_layers(model, Layout(tp=4, dp_shard=16, zero_stage=3, micro_batch_size=1,
                                          sequence_parallel=sequence_parallel))
    plan = Plan(model=model, cluster=load_cluster("dgx-h100", 64),
                training=TrainingSpec(seq_len=2048, global_batch_size=16), layout=lay)
    doc = validate_plan(plan, ranks=[0])
    assert doc["tracked_peak_bytes"] > 5 * 2**30  # the step really ran: weights, states and 32 layers' activations
    assert abs(doc["error"]) <= 0.05, (doc["predicted_peak_bytes"], doc["tracked_peak_bytes"], doc["error"])


@pytest.mark.parametrize("apart", [False, True])
def test_sharding_propagation_is_not_counted_as_memory(apart):
    """The harness's tracker sees what a rank allocates, not DTensor's global-shape shape inference.

    A vocabulary-parallel loss over tp 4 under FakeTensorMode, as validate-memory runs it: the loss backward
    peaks at 16 B per local logit (the 4 B saved log-probabilities and the fused backward's 12 B, as the
    profiler measures it on real tensors: tests/unit/test_memory_torch.py); without
    `_sharding_propagation_apart` the tracker adds the global (tp times larger) fp32 tensors DTensor makes to
    infer output shapes, 16 B more per local logit at tp 4.
    """
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executor.validate.memory_step import _peak_snapshot, _sharding_propagation_apart
    from planner.memory.activations import LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES, LOGIT_SAVED_BYTES

    tp, tokens, vocab, hidden = 4, 2048, 16384, 64
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (tp,))
        with FakeTensorMode(), _sharding_propagation_apart() if apart else contextlib.nullcontext():
            w = torch.nn.Parameter(distribute_tensor(torch.randn(vocab, hidden, dtype=torch.bfloat16), mesh,
                                                     [Shard(0)]))
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
            y = torch.randint(0, vocab, (tokens,))
            tracker = MemTracker()
            tracker.track_external(w)
            with tracker, loss_parallel():
                # the executor's loss: the logits go straight into it (executor.train.lm_loss_sum)
                F.cross_entropy((DTensor.from_local(x, mesh, [Replicate()]) @ w.t()).float(), y,
                                reduction="sum").backward()
            peak = _peak_snapshot(tracker)["Total"]
    finally:
        dist.destroy_process_group()
    weights = 2 * 2 * vocab * hidden / tp  # the bf16 shard and its gradient
    per_logit = (peak - weights) / (tokens * vocab / tp)
    expected = LOGIT_SAVED_BYTES + LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES
    if apart:
        assert per_logit == pytest.approx(expected, abs=0.5)
    else:
        assert per_logit >= expected + 4 * tp - 0.5


def test_moe_plans_outside_bf16_are_refused_with_the_reason(cli, tmp_path):
    """torch's meta function of the experts' grouped GEMM takes bf16 only: an fp32 MoE plan is refused, not traced."""
    from planner.model.load import load_model

    model = load_model("debug-moe")
    lay = with_stage_layers(model, Layout(dp_shard=4, zero_stage=3, micro_batch_size=1))
    plan = Plan(model=model, cluster=load_cluster("dgx-h100", 4), layout=lay,
                training=TrainingSpec(seq_len=64, global_batch_size=4, dtype="fp32"))
    path = tmp_path / "plan.json"
    plan.save(path)
    r = cli("validate-memory", str(path))
    assert r.code == 2 and "bf16 only (plan dtype fp32)" in r.stderr and "Traceback" not in r.stderr
