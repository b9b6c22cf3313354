"""The networkx graph and the link tables the cost model reads must tell the same story."""

from __future__ import annotations

import pytest

from topologies.cluster_load import load_cluster, preset_names
from topologies.graph import cluster_graph, link_between, node_graph, path_label, rank_path
from topologies.links import derive_labels, nic_of_gpu


@pytest.mark.parametrize("name", preset_names())
def test_graph_paths_agree_with_link_between_and_labels(name):
    """Every rank pair of a two-node cluster: widest-path bandwidth and latency equal link_between, and the
    label nvidia-smi would print (the deepest PCIe level the path climbs) equals the derived label."""
    c = load_cluster(name)
    c = c.with_gpus(2 * c.gpus_per_node)
    g, labels = cluster_graph(c), derive_labels(c)
    per = c.gpus_per_node
    # every source rank on a server; on a rack-scale NVLink domain (72 GPUs of 4-GPU trays, all alike) the
    # sources that differ: first and second GPU of the first two trays and the last GPU, to every rank
    sources = range(c.world_size) if per <= 16 else sorted({0, 1, 4, 5, per - 1})
    for a in sources:
        for b in range(c.world_size):
            if a == b:
                continue
            bw, lat, path = rank_path(c, a, b)
            assert (bw, lat) == pytest.approx(link_between(c, a, b)), (a, b, path)
            if a // per == b // per:
                assert path_label(g, path, c.gpu.nvlink_links) == labels[a % per][b % per], (a, b, path)
            else:
                assert any(v.startswith("leaf") for v in path)


def test_rtx4090_box_has_pix_pairs_and_sys_across_sockets():
    labels = derive_labels(load_cluster("rtx4090-pcie"))
    assert labels[0][1] == labels[6][7] == "PIX"
    assert labels[0][2] == "NODE" and labels[0][4] == "SYS"


def test_dgx_nics_are_rail_aligned_and_under_the_gpus_switch():
    c = load_cluster("dgx-a100-80g")
    g = node_graph(c)
    assert [nic_of_gpu(c, i) for i in range(8)] == list(range(8))
    for i in range(8):
        switch = next(v for v in g[f"n0/gpu{i}"] if "/sw" in v)
        assert f"n0/nic{i}" in g[switch]  # two GPUs and their two NICs share each PCIe switch


def test_fabric_is_a_fat_tree_with_oversubscribed_uplinks():
    c = load_cluster("dgx-h100", 8 * 8, {"nodes_per_leaf": "4", "inter_node_oversubscription": "2"})
    g = cluster_graph(c)
    leaves = [v for v in g if v.startswith("leaf")]
    assert len(leaves) == 2 and all(g.has_edge(leaf, "spine") for leaf in leaves)
    uplink = g.edges["leaf0", "spine"]["gbytes_per_s"]
    assert uplink == pytest.approx(4 * 8 * 50 / 2)  # 4 nodes x 8 NICs x 50 GB/s, halved
    _, lat_near, near = rank_path(c, 0, 8)
    _, lat_far, far = rank_path(c, 0, 63)
    assert "spine" in far and "spine" not in near and lat_far > lat_near


@pytest.mark.parametrize("name", preset_names())
def test_widest_paths_inside_a_node_match_networkx(name):
    """An independent reference for the search's own max-bottleneck Dijkstra: inside a node, with the other
    GPUs and the NICs taken out (neither forwards between two GPUs of a node), the widest path's bottleneck
    is the one on the path through networkx's maximum spanning tree (a property of bottleneck paths)."""
    import networkx as nx

    from topologies.graph import widest_path

    c = load_cluster(name)
    g = node_graph(c)
    gpus = [v for v in g if g.nodes[v].get("kind") in ("gpu", "cpu-rank")]
    checked = 0
    for a in gpus[:8]:
        for b in gpus[:8]:
            if a == b:
                continue
            ref = nx.Graph()
            keep = [v for v in g if v in (a, b) or g.nodes[v].get("kind") not in ("gpu", "cpu-rank", "nic")]
            ref.add_nodes_from(keep)
            ref.add_edges_from((u, w, {"bw": e["gbytes_per_s"]}) for u in keep for w, e in g[u].items() if w in keep)
            tree = nx.maximum_spanning_tree(ref, weight="bw")
            route = nx.shortest_path(tree, a, b)
            bottleneck = min(ref.edges[u, w]["bw"] for u, w in zip(route, route[1:], strict=False))
            assert widest_path(g, a, b)[0] == pytest.approx(bottleneck), (a, b)
            checked += 1
    assert checked == len(gpus[:8]) * (len(gpus[:8]) - 1)
