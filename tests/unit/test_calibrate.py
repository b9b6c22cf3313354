"""`meshplan calibrate`: the fits recover known parameters, and the verb writes a usable profile.

The fit tests generate "measurements" with the simulator's own time model
at known parameter values (planner.simulate.compute, topologies.collectives) and check
the fit gives those values back: an independent check of the inversion,
since the generating parameters never pass through the fitting code.
"""

from __future__ import annotations

import pytest

from executor.calibrate.bench import AttentionSample, GemmSample, MemorySample
from executor.calibrate.comm import CommSample
from executor.calibrate.fit import fit_attention, fit_comm, fit_gemm, fit_memory, optimizer_bytes_per_param
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import attention_core_times, gemm_time_s, memory_time_s, optimizer_time_s
from topologies.cluster_load import load_cluster
from topologies.collectives import CollectiveModel
from topologies.hardware import get_gpu

H100 = get_gpu("h100-sxm")
PEAK = H100.peak_flops("bf16")


def test_gemm_fit_recovers_efficiency_and_knee():
    truth = CalibrationProfile(gemm_efficiency=0.71, gemm_knee=90.0)
    shapes = [(m, n, k) for m in (64, 512, 4096) for n in (256, 4096) for k in (512, 8192)]
    samples = [GemmSample(m, n, k, "bf16", gemm_time_s(m, n, k, PEAK, truth)) for m, n, k in shapes]
    eff, knee = fit_gemm(samples, PEAK, CalibrationProfile())
    assert eff == pytest.approx(0.71, rel=1e-3)
    assert knee == pytest.approx(90.0, rel=1e-3)


def test_gemm_fit_is_robust_to_noise():
    truth = CalibrationProfile(gemm_efficiency=0.6, gemm_knee=40.0)
    shapes = [(m, n, k) for m in (128, 1024, 8192) for n in (1024, 8192) for k in (1024, 8192)]
    noise = [1.05, 0.95, 1.03, 0.97] * 3  # +-5%, zero mean in log
    samples = [GemmSample(m, n, k, "bf16", gemm_time_s(m, n, k, PEAK, truth) * e) for (m, n, k), e in zip(shapes, noise, strict=True)]
    eff, _ = fit_gemm(samples, PEAK, CalibrationProfile())
    assert eff == pytest.approx(0.6, rel=0.05)


def test_attention_memory_and_optimizer_fits_invert_the_model():
    truth = CalibrationProfile(attention_efficiency=0.43, memory_efficiency=0.87, optimizer_bytes_per_param=30.0)
    att = []
    for b, h, s, d in ((1, 16, 1024, 128), (2, 32, 2048, 64)):
        fwd, bwd = attention_core_times(b * h, s, s, d, 2, 0.0, True, H100, PEAK, truth)
        att.append(AttentionSample(b, h, s, d, "bf16", fwd + bwd))
    assert fit_attention(att, H100, PEAK, CalibrationProfile()) == pytest.approx(0.43, rel=1e-9)
    copies = [MemorySample(n, memory_time_s(2 * n, H100, truth)) for n in (1 << 28, 1 << 30)]
    assert fit_memory(copies, H100, CalibrationProfile()) == pytest.approx(0.87, rel=1e-9)
    t = optimizer_time_s(1e8, "adamw", H100, truth)
    assert optimizer_bytes_per_param(t, 10**8, H100, 0.87) == pytest.approx(30.0, rel=1e-9)


@pytest.mark.parametrize("cluster_name,n", [("cpu", 4), ("dgx-h100", 8)])
def test_comm_fit_recovers_link_efficiency_and_latency(cluster_name, n):
    cluster = load_cluster(cluster_name, n)
    from executor.calibrate.fit import local_link_classes
    from topologies.links import EFFICIENCY

    classes = local_link_classes(cluster)
    truth = {c: 0.5 * EFFICIENCY[c] for c in classes}
    model = CollectiveModel(cluster, efficiency=truth, latency_scale=3.0)
    samples = [CommSample(op, k, size, model.time_s(op, size, tuple(range(k))))
               for k in range(2, n + 1) for op in ("all_reduce", "all_gather", "reduce_scatter")
               for size in (1 << 12, 1 << 18, 1 << 24, 1 << 28)]
    samples += [CommSample("send_recv", 2, size, model.time_s("send_recv", size, (0, 1))) for size in (1 << 12, 1 << 24)]
    eff, latency_scale = fit_comm(samples, cluster)
    assert set(eff) == set(classes)
    for c in classes:
        assert eff[c] == pytest.approx(truth[c], rel=0.02), c
    assert latency_scale == pytest.approx(3.0, rel=0.05)


def test_no_comm_samples_keep_defaults():
    assert fit_comm([], load_cluster("cpu", 1)) is None


def test_gpu_names_map_to_the_catalog():
    """calibrate maps torch.cuda.get_device_name() with the same function `topo detect` uses."""
    from topologies.errors import UsageError
    from topologies.smi_topo import gpu_from_smi_name

    assert gpu_from_smi_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert gpu_from_smi_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert gpu_from_smi_name("NVIDIA A100-SXM4-40GB").name == "a100-40g-sxm"
    assert gpu_from_smi_name("NVIDIA A100-SXM4-80GB").name == "a100-80g-sxm"
    assert gpu_from_smi_name("NVIDIA GeForce RTX 4090").name == "rtx4090"
    with pytest.raises(UsageError):
        gpu_from_smi_name("Imaginary Accelerator 9000")
