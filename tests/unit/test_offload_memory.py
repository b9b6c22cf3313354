"""The GPU memory of parameter-offload plans (FSDP2's CPUOffloadPolicy) against PyTorch's tracker.

`meshplan validate-memory`'s harness (executor.validate.memory_step) runs one rank of the plan's world
on CPU under a fake process group and FakeTensorMode with the executor's own model, parallelization
(CPUOffloadPolicy applied) and AdamW; the offloaded categories (sharded parameters, their gradients, the
optimizer state) are split off as host memory and the GPU's peak is the rest at its largest moment.
Scaled-down copies of the models `plan --offload auto` answers on 4x RTX 4090 (Qwen2.5-7B's and
Llama-3-8B's shapes: GQA, SwiGLU, Qwen's QKV biases) must land within 5% of that peak, whichever
moment holds it, and the host share tracked at the GPU's peak never exceeds the memory model's host bytes.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster

TOLERANCE = 0.05
SHAPE = dict(n_layers=4, hidden=512, n_heads=4, n_kv_heads=2, head_dim=128, ffn_hidden=1536, vocab=8192)

# name: (model, seq_len, micro-batch, grad_accum_steps, layout changes)
CASES = {
    "qwen_fsdp4": ("tests/data/hf_configs/qwen2.5-7b.json", 512, 2, 1, {}),
    "qwen_fsdp4_accum_full": ("tests/data/hf_configs/qwen2.5-7b.json", 512, 1, 2, dict(recompute="full")),
    "llama_fsdp4_short": ("llama3-8b", 64, 1, 2, {}),
    "llama_hsdp_2x2_op": ("llama3-8b", 256, 2, 1, dict(dp_replicate=2, dp_shard=2, recompute="op")),
}


def _plan(model_name: str, seq_len: int, micro_batch: int, accum: int, changes: dict) -> Plan:
    model = dataclasses.replace(load_model(model_name), name=f"{load_model(model_name).name}-small", **SHAPE)
    layout = with_stage_layers(model, Layout(**{"dp_shard": 4, "zero_stage": 3, "offload": "optimizer+params",
                                                "micro_batch_size": micro_batch, "grad_accum_steps": accum,
                                                **changes}))
    return Plan(model=model, cluster=load_cluster("rtx4090-pcie", 4),
                training=TrainingSpec(seq_len=seq_len, global_batch_size=micro_batch * accum * layout.dp),
                layout=layout)


@pytest.mark.parametrize("name", CASES)
def test_offload_gpu_peak_matches_torch_tracker(name):
    from executor.validate.memory import validate_plan

    plan = _plan(*CASES[name])
    report = validate_plan(plan, [0])
    rank = report["ranks"][0]
    assert rank["tracked_peak_bytes"] > 1 << 20
    assert abs(report["error"]) <= TOLERANCE, (name, report["predicted_peak_bytes"], report["tracked_peak_bytes"])
    # nothing the policy offloads is counted on the GPU, by either side
    assert rank["by_category"]["optimizer"] == {"predicted": 0, "tracked": 0, "difference": 0}
    assert rank["by_category"]["grads"]["tracked"] == 0 == rank["by_category"]["grads"]["predicted"]
    host = rank["host"]
    assert 0 < host["tracked_bytes"] <= host["predicted_bytes"]


def test_the_split_is_what_moves_the_peak():
    """Without the split the tracker's peak (GPU and host together) is far above the GPU's own."""
    from executor.validate.memory_step import tracked_peak

    plan = _plan(*CASES["qwen_fsdp4_accum_full"])
    split = tracked_peak(plan, 0)
    whole = tracked_peak(dataclasses.replace(plan, layout=plan.layout.replace(offload="none")), 0)
    assert split["Total"] + split["Host"] > split["Total"]
    assert whole["Total"] > 1.2 * split["Total"]
