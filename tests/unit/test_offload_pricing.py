"""CPU offload pricing (planner.simulate.offload) against hand computations from the cited figures.

Host link: PCIe x16 payload = raw rate (PCI-SIG: 15.75 / 31.5 / 63 GB/s per direction for Gen 3 / 4 / 5)
x 0.8, shared by the GPUs behind one switch; NVLink-C2C 450 GB/s per direction per Grace, shared by its
GPUs. Host optimizer step: 30 B per parameter (AdamW) through the node's DRAM at 60% of its peak, shared
by the node's GPUs, at most 8 GB/s per core each GPU's process gets.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.engines import get_engine
from planner.layout import Layout
from planner.memory.params import layer_params_split, pipeline_params
from planner.memory.states import model_states
from planner.model.load import load_model
from planner.search.candidates import Pins
from planner.search.search import search
from planner.simulate.offload import (
    cpu_optimizer_time_s,
    host_link_bytes,
    host_link_gbytes_per_s,
    host_refusal,
    host_stated,
    layer_offload_s,
    offloaded_step_s,
)
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster, preset_names
from topologies.errors import UsageError

QWEN = "tests/data/hf_configs/qwen2.5-7b.json"


def test_host_link_per_gpu_from_the_pcie_generation_and_its_sharing():
    assert host_link_gbytes_per_s(load_cluster("rtx4090-pcie", 4)) == pytest.approx(31.5 * 0.8 / 2)  # PIX pairs
    assert host_link_gbytes_per_s(load_cluster("dgx-h100", 8)) == pytest.approx(63.0 * 0.8)  # one GPU per switch
    assert host_link_gbytes_per_s(load_cluster("t4-pcie", 4)) == pytest.approx(15.75 * 0.8 / 2)
    assert host_link_gbytes_per_s(load_cluster("gb200-nvl72", 72)) == pytest.approx(450 / 2)  # C2C, 2 GPUs a Grace


def test_cpu_adam_time_is_the_dram_share_or_the_cores_share():
    c = load_cluster("rtx4090-pcie", 4)  # 409.6 GB/s DDR4, 64 cores, 4 GPUs
    per_gpu = min(409.6 * 0.6 / 4, 64 / 4 * 8.0)  # 61.44 GB/s: bandwidth-bound
    assert cpu_optimizer_time_s(1.9e9, "adamw", c) == pytest.approx(1.9e9 * 30 / (per_gpu * 1e9))
    few_cores = load_cluster("rtx4090-pcie", 8, {"host_cores": "16"})  # 2 cores a GPU: 16 GB/s < 30.72
    assert cpu_optimizer_time_s(1e9, "adamw", few_cores) == pytest.approx(1e9 * 30 / 16e9)
    assert cpu_optimizer_time_s(1e9, "sgd", few_cores) == pytest.approx(1e9 * 22 / 16e9)


def test_host_link_bytes_per_step():
    opt = Layout(dp_shard=4, zero_stage=3, offload="optimizer", grad_accum_steps=8)
    moved = host_link_bytes(2e9, 6e7, 28, opt, dtype_bytes=2, grad_bytes=4)
    assert (moved.down, moved.up) == (8 * 2e9 * 4, 2e9 * 2)  # gradients every micro-batch; weights once
    params = dataclasses.replace(opt, offload="optimizer+params")
    moved = host_link_bytes(2e9, 6e7, 28, params, dtype_bytes=2, grad_bytes=4)
    rest = (2e9 - 6e7 * 28) * 2  # embedding and head shards
    assert moved.down == 8 * 2e9 * 4
    assert moved.up == pytest.approx(8 * 2 * (6e7 * 28 * 2 + rest))  # each unit up in forward and backward
    assert host_link_bytes(2e9, 6e7, 28, dataclasses.replace(opt, offload="none"), 2, 4).up == 0


def test_layer_copies_exposed_beyond_the_pass_that_hides_them():
    model = load_model(QWEN)
    layout = Layout(dp_shard=4, zero_stage=3, offload="optimizer+params")
    dense, experts = layer_params_split(model, 1, 1, 1)
    shard = (dense + experts) / 4
    up_s, down_s = shard * 2 / 12.6e9, shard * 4 / 12.6e9
    assert layer_offload_s(model, layout, 2, 4, 12.6, 0.0, 0.0) == pytest.approx((up_s, max(up_s, down_s)))
    assert layer_offload_s(model, layout, 2, 4, 12.6, up_s, 10.0) == (0.0, 0.0)  # hidden by compute
    # in series with the unit's all-gather: a gather that alone fills the forward leaves every copy exposed
    assert layer_offload_s(model, layout, 2, 4, 12.6, 1.0, 10.0, gather_s=1.0)[0] == pytest.approx(up_s)
    f, b = layer_offload_s(model, dataclasses.replace(layout, offload="optimizer"), 2, 4, 12.6, 0.0, 0.0)
    assert (f, b) == (0.0, pytest.approx(down_s))  # optimizer offload: gradients down only


def test_step_optimizer_time_is_the_host_step_plus_the_upload():
    model, cluster = load_model(QWEN), load_cluster("rtx4090-pcie", 4)
    training = TrainingSpec(seq_len=4096, global_batch_size=16)
    for kind in ("optimizer", "optimizer+params"):
        layout = Layout(dp_shard=4, zero_stage=3, offload=kind, micro_batch_size=1, grad_accum_steps=4,
                        recompute="full")
        result = simulate_step(model, training, layout, cluster, engine="deepspeed")
        local = pipeline_params(model, layout, "deepspeed")[0].total / 4
        cpu = local * 30 / (409.6 * 0.6 / 4 * 1e9)
        up = local * 2 / (12.6e9) if kind == "optimizer" else 0.0
        assert offloaded_step_s(local, "adamw", layout, 2, cluster) == pytest.approx((cpu, up))
        assert result.time_breakdown_s["optimizer"] == pytest.approx(cpu + up)
        assert result.offload["down_bytes"] == pytest.approx(4 * local * 4)
    slower = load_cluster("rtx4090-pcie", 4, {"pcie_gen": "3"})
    layout = Layout(dp_shard=4, zero_stage=3, offload="optimizer+params", micro_batch_size=1, grad_accum_steps=4)
    short = TrainingSpec(seq_len=256, global_batch_size=16)  # too little compute to hide a layer's copies
    fast = simulate_step(model, short, layout, cluster, engine="deepspeed").time_breakdown_s["offload_comm"]
    slow = simulate_step(model, short, layout, slower, engine="deepspeed").time_breakdown_s["offload_comm"]
    assert 0 < fast < slow


def test_host_memory_is_checked_against_the_node():
    model, cluster = load_model(QWEN), load_cluster("rtx4090-pcie", 4)
    training = TrainingSpec(seq_len=4096, global_batch_size=16)
    layout = Layout(dp_shard=4, zero_stage=3, offload="optimizer+params")
    host = model_states(model, training, layout, "meshplan").host
    assert host == pytest.approx(model.total_params * 16 / 4, rel=0.01)  # fp32 params + grads + two moments
    assert host_refusal(host, cluster) is None  # 4 x 28 GiB of 0.8 x 512
    small = load_cluster("rtx4090-pcie", 4, {"host_memory_gib": "100"})
    reason = host_refusal(host, small)
    assert "113.5 GiB" in reason and "80.0" in reason and "host_memory_gib" in reason
    found = search(model, small, 4096, 16, Pins(offload="optimizer+params"), top_k=1)
    assert not found.ranked and found.stats.host_pruned > 0 and "host memory" in found.stats.host_reason


def test_auto_searches_offload_only_where_nothing_else_fits_or_is_faster():
    model = load_model(QWEN)
    cluster = load_cluster("rtx4090-pcie", 4)
    assert not search(model, cluster, 4096, 16, Pins(), top_k=1).ranked  # 30 GiB of state per GPU
    best = search(model, cluster, 4096, 16, Pins(offload="auto"), top_k=3).ranked
    assert best and all(s.layout.offload == "optimizer+params" for s in best)
    big = load_cluster("dgx-h100", 8)
    assert search(model, big, 4096, 64, Pins(offload="auto"), top_k=1).best.layout.offload == "none"


def test_engines_offload_what_they_run():
    layout = Layout(dp_shard=4, zero_stage=3, offload="optimizer")
    model = load_model(QWEN)
    assert "does not offload 'optimizer'" in get_engine("meshplan").refusal(model, layout, "bf16", True)
    assert get_engine("deepspeed").refusal(model, layout, "bf16", True) is None
    assert get_engine("megatron").refusal(model, layout, "bf16", True) is None
    assert "does not offload" in get_engine("megatron@core-0.11").refusal(model, layout, "bf16", True)
    params2 = Layout(dp_shard=4, zero_stage=2, offload="optimizer+params")
    assert "needs ZeRO-3" in get_engine("deepspeed").refusal(model, params2, "bf16", True)
    zero0 = Layout(dp_replicate=4, dp_shard=1, zero_stage=0, offload="optimizer")
    assert "needs ZeRO 1-3" in get_engine("deepspeed").refusal(model, zero0, "bf16", True)


def test_every_preset_states_its_host_and_a_bare_file_is_refused(tmp_path):
    for name in preset_names():
        assert host_stated(load_cluster(name)) is None, name
    bare = tmp_path / "box.toml"
    bare.write_text('gpu = "rtx4090"\ngpus_per_node = 4\nintra_node = "pcie"\n')
    reason = host_stated(load_cluster(str(bare)))
    assert "host_memory_gib" in reason and "host_cores" in reason
    with pytest.raises(UsageError, match="does not state its host"):
        search(load_model(QWEN), load_cluster(str(bare)), 4096, 16, Pins(offload="optimizer+params"))
    # auto without a host: searched without offload (nothing fits here)
    assert not search(load_model(QWEN), load_cluster(str(bare)), 4096, 16, Pins(offload="auto")).ranked


def test_rack_scale_domain_gives_a_partial_node_its_trays_host():
    full = load_cluster("gb200-nvl72")
    four = load_cluster("gb200-nvl72", 4)  # one tray of 18: 2 Graces
    assert four.host_memory_bytes == full.host_memory_bytes // 18
    assert four.host_cores == 144 and four.host_memory_gbytes_per_s == pytest.approx(1024)
    assert load_cluster("rtx4090-pcie", 4).host_memory_bytes == load_cluster("rtx4090-pcie").host_memory_bytes
