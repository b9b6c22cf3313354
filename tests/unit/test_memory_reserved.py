"""The caching allocator's reserve (planner.memory.reserved): allocated vs reserved, and torchtitan's figures.

torchtitan logs `reserved_bytes.all.peak` of torch.cuda.memory_stats (its
metrics.DeviceMemoryMonitor), with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(its run_llama_train.sh). Its published Llama 3.1 8B runs
(pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and
3: bf16, FSDP, local batch 2, seq 8192, selective op AC, H100 with 96 GB
HBM2e): 82.4 GiB on 8 GPUs, 67.0 GiB on 128.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.model.load import load_model
from planner.training import TrainingSpec, training_for
from topologies.hardware import GIB, get_gpu

LLAMA8 = load_model("llama3-8b")
H100_96 = dataclasses.replace(get_gpu("h100-sxm"), memory_bytes=96 * 10**9)
TORCHTITAN_RESERVED_GIB = {8: 82.4, 128: 67.0}  # benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3


@pytest.mark.parametrize("gpus", sorted(TORCHTITAN_RESERVED_GIB))
def test_meshplan_predicts_torchtitans_published_8b_reserved_peak_within_15_percent(gpus):
    measured = TORCHTITAN_RESERVED_GIB[gpus]
    training = training_for(8192, 2 * gpus, "bf16")
    layout = Layout(dp_shard=gpus, zero_stage=3, micro_batch_size=2, recompute="op")
    est = estimate_memory(LLAMA8, training, layout, H100_96, "meshplan")
    error = (est.reserved_bytes / GIB - measured) / measured
    assert abs(error) <= 0.15, f"{gpus} GPUs: predicted {est.reserved_bytes / GIB:.1f} GiB vs {measured} ({error:+.1%})"
    # the reserve is what the allocated figure alone misses: without it the 8-GPU run falls outside 15%
    assert est.allocated_bytes < est.reserved_bytes < est.peak_bytes
    if gpus == 8:
        assert (measured - est.allocated_bytes / GIB) / measured > 0.15
    # what fills the reserve, term by term: every fp32 gradient shard in the reduce-scatter stream's pool,
    # two units gathered in bf16 in the all-gather stream's (embedding unit + first block, the largest pair),
    # and the bf16 logits' place the loss backward cannot reuse
    h, v, tokens, p = LLAMA8.hidden, LLAMA8.vocab, 2 * 8192, LLAMA8.total_params
    block = (p - 2 * v * h - h) / LLAMA8.n_layers
    expected = 4 * p / gpus + 2 * (v * h + block) + 2 * tokens * v
    assert est.reserve_bytes == pytest.approx(expected, rel=0.01)


def test_no_reserve_without_a_caching_allocator_or_with_the_papers_accounting():
    training, layout = TrainingSpec(seq_len=2048, global_batch_size=8), Layout(dp_shard=8, zero_stage=3)
    cpu = estimate_memory(LLAMA8, training, layout, get_gpu("cpu"))
    assert cpu.reserve_bytes == 0 and cpu.allocated_bytes == cpu.reserved_bytes
    for engine in ("megatron", "deepspeed"):  # their fixed `other` keeps the allocator slack
        assert estimate_memory(LLAMA8, training, layout, H100_96, engine).reserve_bytes == 0


def test_one_pool_without_fsdp_leaves_only_the_loss_hole():
    """DDP and the single-GPU path allocate on the default stream: the bf16 logits' hole is the reserve."""
    training = TrainingSpec(seq_len=2048, global_batch_size=8)
    small = load_model("llama3.2-1b")
    hole = 2 * 2048 * small.vocab
    ddp = estimate_memory(small, training, Layout(dp_shard=8, zero_stage=1), H100_96)
    assert ddp.peak_phase == "backward_start" and ddp.reserve_bytes == hole
    # one GPU at 1,024 tokens peaks later in the backward (the head's reduction); the loss backward's
    # high-water mark (its phase + the hole) is below that, so the reserve adds nothing: reserved is the
    # largest high-water mark, not a sum
    one = estimate_memory(small, TrainingSpec(seq_len=1024, global_batch_size=8), Layout(), H100_96)
    start = sum(one.phases["backward_start"].values()) - one.other_bytes - one.reserve_bytes
    assert one.peak_phase == "output_backward"
    assert one.reserve_bytes == max(0, start + 2 * 1024 * small.vocab - one.allocated_bytes) == 0
    fp32 = estimate_memory(small, TrainingSpec(seq_len=2048, global_batch_size=1, dtype="fp32"), Layout(), H100_96)
    assert fp32.reserve_bytes == 0  # .float() of fp32 logits is the same tensor: no copy, no hole


def test_plan_json_carries_allocated_and_reserved():
    est = estimate_memory(LLAMA8, training_for(8192, 16), Layout(dp_shard=8, zero_stage=3, micro_batch_size=2,
                                                                  recompute="op"), H100_96)
    j = est.to_json()
    assert j["allocated_peak_bytes"] == est.allocated_bytes < j["reserved_peak_bytes"] == est.reserved_bytes
    assert sum(j["memory_breakdown_bytes"].values()) == j["peak_memory_bytes"]
    assert j["memory_breakdown_bytes"]["other"] == est.other_bytes + est.reserve_bytes


def test_gpu_workers_run_with_expandable_segments_unless_the_user_chose(monkeypatch):
    import os

    from executor.launch import _worker_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # _worker_env prepends the repository
    _worker_env(8, on_cpu=True)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    _worker_env(8, on_cpu=False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    _worker_env(8, on_cpu=False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_replicate_accumulates_on_the_default_stream_fsdp_in_the_reduce_scatter_pool():
    """Accumulating micro-batches: FSDP2 adds each one's reduce-scatter output into the shards it keeps in the
    reduce-scatter stream's pool (reserved grows by one unit's output), while replicate (TP or PP with ZeRO-0/1)
    sums unsharded gradients on the default stream before reducing them into that pool (reserved grows by
    those sums, the pool keeps its own peak)."""
    training = TrainingSpec(seq_len=2048, global_batch_size=64)
    small = load_model("llama3.2-1b")
    for layout in (Layout(dp_shard=8, zero_stage=3), Layout(tp=2, dp_replicate=4)):
        one = estimate_memory(small, training, layout, H100_96)
        two = estimate_memory(small, training, layout.replace(grad_accum_steps=2), H100_96)
        grown = two.allocated_bytes - one.allocated_bytes
        assert grown > 0
        if layout.zero_stage == 3:  # the shards were reserved already
            assert two.reserved_bytes - one.reserved_bytes < grown / 4
        else:
            assert two.reserved_bytes - one.reserved_bytes >= grown
