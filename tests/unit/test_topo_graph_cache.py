"""The link tables the cost model reads are a cache of the topology graph, and say what the label prices say.

`topologies.graph.node_link_table` and `gpu_nic_paths` are read off the graph
(widest paths). Here they are checked against the independent pricing of
`topologies.links` (nvidia-smi label -> bandwidth and latency; PXN as "the
best of straight to the NIC, or one hop to a peer and from there") for every
preset and every measured `nvidia-smi topo -m` fixture, and the cache is
built once per cluster.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from topologies.cluster import Cluster
from topologies.cluster_load import load_cluster, preset_names
from topologies.errors import TopologyError
from topologies.graph import gpu_nic_paths, node_graph, node_link_table, widest_path
from topologies.hardware import get_gpu
from topologies.links import derive_labels, label_gbytes_per_s, label_latency_s, nic_label, nic_of_gpu
from topologies.rocm_topo import is_rocm_topo, parse_rocm_topo
from topologies.smi_topo import detect_cluster, guess_gpu, parse_topo

FIXTURES = sorted((Path(__file__).parent.parent / "data" / "topo").glob("*.txt"))


def _reference_nic_paths(c):
    """Straight over PCIe to the rail NIC, or NVLink/PCIe to a peer first (NCCL's PXN): widest, then quickest."""
    labels = derive_labels(c)
    out = []
    for i in range(c.gpus_per_node):
        nic, best = nic_of_gpu(c, i), (-1.0, 0.0)
        for r in range(c.gpus_per_node):
            lab = nic_label(c, r, nic)
            bw, lat = min(label_gbytes_per_s(lab, c.gpu), c.nic_gbytes_per_s), label_latency_s(lab)
            if r != i:
                bw = min(bw, label_gbytes_per_s(labels[i][r], c.gpu))
                lat += label_latency_s(labels[i][r])
            if (bw, -lat) > (best[0], -best[1]):
                best = (bw, lat)
        out.append(best)
    return out


def _clusters():
    for name in preset_names():
        yield name, load_cluster(name)
    for path in FIXTURES:
        text = path.read_text()
        if is_rocm_topo(text):  # rocm-smi captures: AMD's xGMI or PCIe nodes, priced as MI300X
            yield path.name, detect_cluster(parse_rocm_topo(text).topo, get_gpu("mi300x"), lists_nics=False)
            continue
        topo = parse_topo(text)
        # the matrix names no GPU in some fixtures: price them as V100s (NVLink) when guessing fails
        try:
            gpu = guess_gpu(topo)
        except TopologyError:
            gpu = get_gpu("v100")
        yield path.name, detect_cluster(topo, gpu)


@pytest.mark.parametrize("name,cluster", list(_clusters()), ids=lambda v: v if isinstance(v, str) else "")
def test_cache_agrees_with_the_label_prices(name, cluster):
    table, labels = node_link_table(cluster), derive_labels(cluster)
    n = cluster.gpus_per_node
    for i in range(n):
        for j in range(n):
            assert table.labels[i][j] == labels[i][j], (i, j)
            if i != j:
                assert table.gbytes_per_s[i][j] == pytest.approx(label_gbytes_per_s(labels[i][j], cluster.gpu))
                assert table.latency_s[i][j] == pytest.approx(label_latency_s(labels[i][j]))
    if cluster.nics_per_node:
        for got, want in zip(gpu_nic_paths(cluster), _reference_nic_paths(cluster), strict=True):
            assert got == pytest.approx(want)


def test_the_graph_is_built_once_per_cluster():
    c = load_cluster("dgx-h100", 16)
    node_link_table.cache_clear()
    for _ in range(3):
        node_link_table(c)
    assert node_link_table.cache_info().misses == 1


@dataclasses.dataclass(frozen=True)
class _Rack(Cluster):
    """A rack-scale NVLink domain: compute trays of `gpus_per_tray` GPUs on one NVSwitch fabric."""

    gpus_per_tray: int = 4


def test_an_nvlink_domain_of_trays_is_priced_from_its_graph():
    base = load_cluster("dgx-b200")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Cluster)}
    rack = _Rack(**{**fields, "name": "rack", "gpus_per_node": 72, "nics_per_node": 72, "gpus_per_numa_node": 2,
                    "gpus_per_pcie_switch": 1, "gpus_per_tray": 4})
    g = node_graph(rack)
    table = node_link_table(rack)
    nv = label_gbytes_per_s(f"NV{base.gpu.nvlink_links}", base.gpu)
    assert all(table.gbytes_per_s[i][j] == nv for i in range(72) for j in range(72) if i != j)
    # no PCIe between trays: the sockets of tray 0 and tray 1 are not joined, inside a tray they are
    assert g.has_edge("n0/cpu0", "n0/cpu1") and not g.has_edge("n0/cpu1", "n0/cpu2")
    # each GPU reaches its own NIC over its tray's PCIe, at the NIC's line rate
    for i in (0, 5, 71):
        bw, _, path = widest_path(g, f"n0/gpu{i}", f"n0/nic{nic_of_gpu(rack, i)}", 1)
        assert bw == pytest.approx(rack.nic_gbytes_per_s) and "n0/nvswitch" not in path
