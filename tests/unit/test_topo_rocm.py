"""`rocm-smi --showtopo` parsing on captures in its 6.x layout (tests/data/topo/rocm_*.txt)."""

from __future__ import annotations

from pathlib import Path

import pytest

from topologies.cluster_load import load_cluster
from topologies.collectives import CollectiveModel
from topologies.errors import TopologyError
from topologies.hardware import get_gpu
from topologies.rocm_topo import gpu_of_capture, is_rocm_topo, parse_rocm_topo
from topologies.smi_topo import detect_cluster

DATA = Path(__file__).resolve().parent.parent / "data" / "topo"


def sample(name: str) -> str:
    return (DATA / f"{name}.txt").read_text()


def test_mi300x_platform_with_product_and_memory_lines():
    text = sample("rocm_mi300x_8gpu")
    assert is_rocm_topo(text) and not is_rocm_topo(sample("pcie_pix_pairs"))
    cap = parse_rocm_topo(text)
    t = cap.topo
    assert len(t.gpus) == 8 and all(t.gpu_links[i][j] == ("X" if i == j else "XGMI")
                                    for i in range(8) for j in range(8))
    assert t.numa_affinity == ("0",) * 4 + ("1",) * 4 and cap.hops[0][7] == 1 and cap.weights[3][4] == 15
    gpu = gpu_of_capture(cap)
    assert gpu.name == "mi300x" and gpu.memory_bytes == 206141652992  # what the driver reports, not the sheet
    c = detect_cluster(t, gpu, source="rocm-smi --showtopo", lists_nics=False)
    assert c.intra_node == "xgmi" and c.nics_per_node == 8 and "assumed" in c.description
    # the detected node prices like the preset: the same full mesh
    preset = load_cluster("mi300x")
    ranks = tuple(range(8))
    assert CollectiveModel(c).time_s("all_reduce", 1 << 30, ranks) == \
        pytest.approx(CollectiveModel(preset).time_s("all_reduce", 1 << 30, ranks))


def test_topology_only_capture_needs_the_gpu_named():
    cap = parse_rocm_topo(sample("rocm_mi300x_topo_only"))
    assert cap.card_series == () and cap.vram_bytes == () and gpu_of_capture(cap) is None
    c = detect_cluster(cap.topo, get_gpu("mi355x"), lists_nics=False)
    assert c.gpu.name == "mi355x" and c.intra_node == "xgmi"
    with pytest.raises(TopologyError, match="Infinity Fabric.*h100-sxm has none"):
        detect_cluster(cap.topo, get_gpu("h100-sxm"), lists_nics=False)


def test_pcie_cards_on_two_sockets():
    """PCIE pairs become NODE on one NUMA node and SYS across; the product line printed before the topology
    names a GPU the catalog lacks, and the error says how to describe it."""
    cap = parse_rocm_topo(sample("rocm_pcie_2socket"))
    assert cap.topo.gpu_links[0] == ("X", "NODE", "SYS", "SYS") and cap.topo.gpu_links[2][3] == "NODE"
    assert cap.hops[0] == (0, 2, 3, 3) and cap.weights[0][2] == 72
    with pytest.raises(TopologyError, match="MI210' is not in the catalog.*--set gpu="):
        gpu_of_capture(cap)
    c = detect_cluster(cap.topo, get_gpu("mi300x"), lists_nics=False)
    assert c.intra_node == "pcie"
    model = CollectiveModel(c)
    assert model.time_s("all_reduce", 1 << 28, (0, 2)) > model.time_s("all_reduce", 1 << 28, (0, 1))


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace("Link Type between two GPUs", "Link Kind"), "no `rocm-smi --showtopo` link matrix"),
    (lambda t: t.replace("GPU1   XGMI         0 ", "GPU1   PCIE         0 ", 1), "must be symmetric"),
    (lambda t: t.replace("GPU2   XGMI         XGMI         0", "GPU2   XGMI         NVLINK       0", 1),
     "unknown link type 'NVLINK'"),
    (lambda t: t.replace("GPU0   0            XGMI", "GPU0   7            XGMI", 1), "GPU0 with itself is '7'"),
    (lambda t: t.replace("GPU7   XGMI         XGMI         XGMI         XGMI         XGMI         XGMI         XGMI"
                         "         0", "GPU7   XGMI", 1), "row GPU7 .* does not have 8 cells"),
])
def test_malformed_captures_are_clear_errors(edit, words):
    text = edit(sample("rocm_mi300x_topo_only"))
    with pytest.raises(TopologyError, match=words):
        parse_rocm_topo(text)
