"""`nvidia-smi topo -m` parsing on four samples written in the real format (tests/data/topo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from topologies.cluster import Cluster
from topologies.collectives import CollectiveModel
from topologies.errors import TopologyError
from topologies.hardware import get_gpu
from topologies.smi_topo import detect_cluster, gpu_from_smi_name, guess_gpu, parse_topo

DATA = Path(__file__).resolve().parent.parent / "data" / "topo"


def sample(name: str) -> str:
    return (DATA / f"{name}.txt").read_text()


def test_dgx_with_nics_and_ansi_underlined_header():
    text = sample("dgx_h100_ansi")
    assert "\x1b[4m" in text  # the sample really carries the escape codes
    t = parse_topo(text)
    assert len(t.gpus) == 8 and len(t.nics) == 10 and t.nics[0] == "mlx5_0"
    assert all(t.gpu_links[i][j] == ("X" if i == j else "NV18") for i in range(8) for j in range(8))
    assert t.numa_affinity == ("0",) * 4 + ("1",) * 4 and t.cpu_affinity[5] == "56-111,168-223"
    c = detect_cluster(t, guess_gpu(t))
    # storage NICs (no GPU behind their switch) drop out; the compute NICs line up with the GPUs
    assert c.gpu.name == "h100-sxm" and c.intra_node == "nvswitch" and c.nics_per_node == 8
    assert [row[i] for i, row in enumerate(c.gpu_nic_links)] == ["PIX"] * 8


def test_pcie_box_with_pix_pairs():
    t = parse_topo(sample("pcie_pix_pairs"))
    assert t.gpu_links[0][1] == t.gpu_links[2][3] == "PIX" and t.gpu_links[1][2] == "NODE"
    assert t.gpu_links[0][7] == "SYS" and t.gpu_nic_links[0] == ("PIX",)
    with pytest.raises(TopologyError, match="pass --gpu NAME"):
        guess_gpu(t)  # no NVLink: the matrix cannot tell which GPU this is
    c = detect_cluster(t, get_gpu("rtx4090"))
    assert c.intra_node == "pcie" and c.nics_per_node == 1


def test_mixed_pxb_node_sys_pasted_with_spaces():
    text = sample("mixed_pxb_node_sys")
    assert "\t" not in text
    t = parse_topo(text)
    assert t.gpu_links[0][1] == "NV12" and t.gpu_links[0][2] == "PXB"
    assert t.gpu_links[4][6] == "NODE" and t.gpu_links[3][4] == "SYS"
    assert t.nics == ("mlx5_0", "mlx5_1") and t.numa_affinity[7] == "1"
    c = detect_cluster(t, get_gpu("a100-80g-pcie"))
    assert Cluster.from_json(c.to_json()) == c  # plan.json embeds detected clusters too
    half = c.with_gpus(4)
    assert half.gpu_links == tuple(row[:4] for row in c.gpu_links[:4]) and len(half.gpu_nic_links) == 4
    model = CollectiveModel(c)
    pair, far = model.time_s("all_reduce", 1 << 28, (0, 1)), model.time_s("all_reduce", 1 << 28, (0, 4))
    assert far > 5 * pair  # NV12 bridge vs a cross-socket hop


def test_old_driver_without_numa_columns():
    t = parse_topo(sample("old_driver_dgx1"))
    assert t.numa_affinity == ("",) * 8 and t.cpu_affinity[0] == "0-19,40-59"
    assert t.nics == ("mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3")  # old headers name NICs by device
    assert t.gpu_links[0][5] == "SYS"  # printed as SOC by drivers of that age
    assert t.gpu_links[0][3] == "NV2" and t.gpu_links[0][1] == "NV1"
    c = detect_cluster(t, guess_gpu(t))
    assert c.gpu.name == "v100" and c.intra_node == "pcie"
    # NICs reordered by the GPUs they serve: GPU0/1 -> mlx5_0, GPU2/3 -> mlx5_1, ...
    assert [c.gpu_nic_links[2 * k][k] for k in range(4)] == ["PIX"] * 4


@pytest.mark.parametrize("text, words", [
    ("nothing here\n", "no `nvidia-smi topo -m` matrix"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tSYS\t X \n", "symmetric"),
    ("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n", "unknown link label 'FOO'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\n\n", "no row for GPU1"),
])
def test_malformed_input_is_a_clear_error(text, words):
    with pytest.raises(TopologyError, match=words):
        parse_topo(text)


@pytest.mark.parametrize("smi_name, mib, expect", [
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g-sxm"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40g-sxm"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-80g-pcie"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
    ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx4090"),
    ("Tesla T4", 15360, "t4"),
    ("Tesla V100-SXM2-32GB", 32768, "v100"),
])
def test_query_gpu_names_map_to_the_catalog(smi_name, mib, expect):
    spec = gpu_from_smi_name(smi_name, mib)
    assert spec.name == expect and spec.memory_bytes == mib << 20


def test_unknown_query_gpu_name():
    with pytest.raises(TopologyError, match="not in the catalog; pass --gpu"):
        gpu_from_smi_name("Matrox G200")
