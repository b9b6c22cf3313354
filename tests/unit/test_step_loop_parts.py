"""The step loop's host-side parts: the batch prefetcher, the garbage collector's schedule, the metrics window."""

from __future__ import annotations

import gc
import math

import torch

from executor.components.data import SyntheticTokens, counted_targets, local_batch
from executor.components.data.prefetch import BatchPrefetcher
from executor.components.garbage import GarbageCollection


def test_prefetched_batches_equal_the_batches_built_in_place():
    source = SyntheticTokens(vocab=128, seq_len=16, seed=3)
    cpu = torch.device("cpu")
    prefetcher = BatchPrefetcher(source, global_batch=8, dp=2, dp_rank=1, device=cpu)
    try:
        for position in (0, 8, 16, 40, 48):  # 40: not the one prefetched (a resume), built in place
            inputs, targets, counted = prefetcher.get(position)
            want_inputs, want_targets = local_batch(source, position, 8, 2, 1, cpu)
            assert torch.equal(inputs, want_inputs) and torch.equal(targets, want_targets)
            assert counted == counted_targets(source, position, 8)
            assert not inputs.is_pinned()  # pinned only for a CUDA device
    finally:
        prefetcher.close()


def test_garbage_collection_is_off_in_the_loop_and_restored_after():
    assert gc.isenabled()
    before = gc.get_count()
    collector = GarbageCollection(every_steps=2)
    try:
        assert not gc.isenabled()
        junk = [[] for _ in range(1000)]
        for item in junk:
            item.append(item)  # cycles: only the collector frees them
        del junk
        assert gc.get_count()[0] >= 1000
        collector.step(1)
        assert gc.get_count()[0] >= 1000  # not a collection step
        collector.step(2)
        assert gc.get_count()[0] < 1000  # generation 1 collected at step 2 (and so 0)
    finally:
        collector.close()
    assert gc.isenabled() and before is not None


def test_metrics_window_reads_every_pending_step_once_in_order():
    from executor.components.metrics import MetricsWindow
    from planner.layout import Layout
    from planner.model.load import load_model
    from planner.plan import Plan
    from planner.training import TrainingSpec
    from topologies.cluster_load import load_cluster

    spec = load_model("debug")
    plan = Plan(model=spec, cluster=load_cluster("cpu", 1), training=TrainingSpec(seq_len=64, global_batch_size=8),
                layout=Layout(micro_batch_size=8))
    window = MetricsWindow(plan, torch.device("cpu"), peak_flops=1e12)
    for step, loss in ((1, 2.0), (2, math.nan)):
        window.begin_step()
        window.add(step, 1e-3, torch.tensor(loss, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64))
    records = window.read()
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] == 2.0 and math.isnan(records[1]["loss"])
    assert all(r["grad_norm"] == 0.5 and r["peak_memory_bytes"] > 0 and r["step_time_s"] > 0 for r in records)
    assert records[0]["step_time_s"] == records[1]["step_time_s"] == window.mean_step_s
    assert records[0]["tokens_per_s"] == plan.training.tokens_per_step / records[0]["step_time_s"]
    assert window.read() == [] and window.pending == []
