"""The cluster as a graph: GPUs, NVSwitch, PCIe switches, host bridges, NICs, fabric.

The graph is what the planner prices links from. A preset, a custom TOML, an
`nvidia-smi topo -m` tree or a rack-scale NVLink domain becomes vertices and
edges here (each edge priced by `topologies.links` for its link class), and
every figure the cost model reads is a widest path through it: the GPU x GPU
table of a node (`node_link_table`), each GPU's way to its rail NIC
(`gpu_nic_paths`, NCCL's PXN over NVLink included), and the path between any
two ranks (`link_between`). Those tables are a cache: built once per cluster
(lru_cache on the frozen Cluster), never per layout or candidate, so the
search reads tuples, not the graph. tests/unit/test_topo_graph.py checks the
cache against fresh path queries on the whole cluster's graph.

The label nvidia-smi would print for a pair is the deepest PCIe level its
path climbs (`path_label`).

Rack-scale NVLink domains (a "node" of several compute trays on one NVLink
switch fabric, `Cluster.gpus_per_tray`, when the cluster has it): the
NVSwitch vertex spans the domain, while each tray has its own PCIe tree,
sockets and NICs, with no PCIe path between trays.

Vertices are named "n{node}/gpu{i}", "n{node}/nvswitch", "n{node}/sw{s}"
(PCIe switch), "n{node}/root{r}" (root port with cascaded switches),
"n{node}/cpu{u}" (socket / NUMA node with its host bridges),
"n{node}/nic{j}", "leaf{l}" and "spine". Edges carry `gbytes_per_s` (raw,
per direction), `latency_s` (one way), `kind` (nvlink, xgmi, pcie, nic, net, shm,
measured) and `level` (the nvidia-smi label a path through it reaches).
A path's latency is the sum of its edges, so each PCIe level's edge holds half
the latency step between its label and the one below (a pair climbs it twice).

Drawing: all rails of a leaf group share one leaf vertex. A rail-optimized
fabric has one leaf per rail, but NCCL keeps traffic on its rail, so bandwidth
and latency between ranks are the same.
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache
from typing import NamedTuple

from topologies.errors import TopologyError
from topologies.links import (
    HOST_SHM_GBYTES_PER_S,
    LATENCY_S,
    NET_HOP_LATENCY_S,
    SPINE_EXTRA_LATENCY_S,
    crosses_spine,
    derive_labels,
    label_gbytes_per_s,
    label_latency_s,
    nic_anchor_gpu,
    nic_label,
    nic_of_gpu,
)

_LEVEL_ORDER = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}


class Graph:
    """An undirected graph with vertex and edge attributes: the part of networkx.Graph's interface used here.

    `g[v]` is v's {neighbour: edge attributes}, `g.nodes[v]` its attributes,
    `g.edges[u, v]` an edge's. Its own class rather than networkx, whose
    import alone (~0.1 s) would cost more than every link table of a plan.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}
        self._adj: dict[str, dict[str, dict]] = {}
        self.edges = _Edges(self._adj)

    def add_node(self, v: str, **attr) -> None:
        self.nodes.setdefault(v, {}).update(attr)
        self._adj.setdefault(v, {})

    def add_edge(self, a: str, b: str, **attr) -> None:
        self.add_node(a)
        self.add_node(b)
        data = self._adj[a].get(b, {})
        data.update(attr)
        self._adj[a][b] = self._adj[b][a] = data

    def has_edge(self, a: str, b: str) -> bool:
        return b in self._adj.get(a, {})

    def update(self, other: Graph) -> None:
        """Add `other`'s vertices and edges (attributes shared, as networkx does)."""
        for v, attr in other.nodes.items():
            self.add_node(v, **attr)
        for a, row in other._adj.items():
            for b, data in row.items():
                self._adj[a][b] = data

    def __getitem__(self, v: str) -> dict[str, dict]:
        return self._adj[v]

    def __iter__(self):
        return iter(self._adj)

    def __contains__(self, v: str) -> bool:
        return v in self._adj

    def __len__(self) -> int:
        return len(self._adj)


class _Edges:
    """`g.edges[u, v]`: an edge's attributes."""

    def __init__(self, adj: dict[str, dict[str, dict]]) -> None:
        self._adj = adj

    def __getitem__(self, pair: tuple[str, str]) -> dict:
        a, b = pair
        return self._adj[a][b]


def gpu_vertex(node: int, gpu: int) -> str:
    return f"n{node}/gpu{gpu}"


def gpus_per_tray(c) -> int:
    """GPUs per host (compute tray) of a node; the whole node unless the cluster says otherwise."""
    return getattr(c, "gpus_per_tray", 0) or c.gpus_per_node


def _edge(g: Graph, a: str, b: str, bw: float, lat: float, kind: str, level: str = "") -> None:
    g.add_edge(a, b, gbytes_per_s=bw, latency_s=lat, kind=kind, level=level)


def _add_pcie_tree(g: Graph, c, p: str) -> None:
    """GPUs -> PCIe switch (PIX) -> root port (PXB) -> socket (NODE) -> other socket (SYS)."""
    n, gpu = c.gpus_per_node, c.gpu
    switch = c.gpus_per_pcie_switch
    root = max(c.gpus_per_pcie_root, switch)
    numa = c.gpus_per_numa_node or n
    half = {k: v / 2 for k, v in LATENCY_S.items()}
    for i in range(n):
        _edge(g, f"{p}gpu{i}", f"{p}sw{i // switch}", label_gbytes_per_s("PIX", gpu), half["PIX"], "pcie", "PIX")
    for s in range(-(-n // switch)):
        first = s * switch
        if root > switch:
            _edge(g, f"{p}sw{s}", f"{p}root{first // root}", label_gbytes_per_s("PXB", gpu),
                  half["PXB"] - half["PIX"], "pcie", "PXB")
        else:
            _edge(g, f"{p}sw{s}", f"{p}cpu{first // numa}", label_gbytes_per_s("NODE", gpu),
                  half["NODE"] - half["PIX"], "pcie", "NODE")
    if root > switch:
        for r in range(-(-n // root)):
            _edge(g, f"{p}root{r}", f"{p}cpu{r * root // numa}", label_gbytes_per_s("NODE", gpu),
                  half["NODE"] - half["PXB"], "pcie", "NODE")
    sockets = -(-n // numa)
    tray = gpus_per_tray(c)
    for u in range(sockets - 1):  # sockets in a chain (two-socket boxes: one UPI/xGMI link)
        if (u + 1) * numa % tray == 0:
            continue  # the next socket is in another compute tray: no PCIe or socket link between trays
        _edge(g, f"{p}cpu{u}", f"{p}cpu{u + 1}", label_gbytes_per_s("SYS", gpu),
              LATENCY_S["SYS"] - LATENCY_S["NODE"], "pcie", "SYS")


def _add_measured(g: Graph, c, p: str) -> None:
    """A detected node: one edge per GPU pair with the label nvidia-smi printed (a logical graph)."""
    labels = derive_labels(c)
    for i in range(c.gpus_per_node):
        g.add_node(f"{p}gpu{i}", kind="gpu")
        for j in range(i + 1, c.gpus_per_node):
            lab = labels[i][j]
            _edge(g, f"{p}gpu{i}", f"{p}gpu{j}", label_gbytes_per_s(lab, c.gpu), label_latency_s(lab), "measured", lab)


def _add_nics(g: Graph, c, p: str) -> None:
    """NIC j beside GPU anchor(j) on its PCIe switch; measured nodes: one labelled edge per GPU."""
    nic_bw = c.nic_gbytes_per_s
    for j in range(c.nics_per_node):
        nic = f"{p}nic{j}"
        g.add_node(nic, kind="nic")
        if c.intra_node == "host":
            _edge(g, nic, f"{p}host", min(nic_bw, HOST_SHM_GBYTES_PER_S), LATENCY_S["SHM"] / 2, "shm")
        elif c.gpu_links:
            for i in range(c.gpus_per_node):
                lab = nic_label(c, i, j)
                _edge(g, f"{p}gpu{i}", nic, min(nic_bw, label_gbytes_per_s(lab, c.gpu)), label_latency_s(lab),
                      "nic", lab)
        else:
            _edge(g, nic, f"{p}sw{nic_anchor_gpu(c, j) // c.gpus_per_pcie_switch}", nic_bw, LATENCY_S["PIX"] / 2,
                  "nic", "PIX")


def node_graph(c, node: int = 0) -> Graph:
    """One node: GPUs, NVSwitch or NVLink bridges, the PCIe tree and the NICs."""
    g = Graph()
    p = f"n{node}/"
    for i in range(c.gpus_per_node):
        g.add_node(f"{p}gpu{i}", kind="cpu-rank" if c.intra_node == "host" else "gpu")
    if c.intra_node == "host":
        for i in range(c.gpus_per_node):
            _edge(g, f"{p}gpu{i}", f"{p}host", HOST_SHM_GBYTES_PER_S, LATENCY_S["SHM"] / 2, "shm")
    elif c.gpu_links:
        _add_measured(g, c, p)
    else:
        _add_pcie_tree(g, c, p)
        nv_bw, nv_lat = c.gpu.nvlink_gbytes_per_s, LATENCY_S["NV"]
        if c.intra_node == "nvswitch":
            for i in range(c.gpus_per_node):
                _edge(g, f"{p}gpu{i}", f"{p}nvswitch", nv_bw, nv_lat / 2, "nvlink")
        elif c.nvlink_bridge_pairs:
            for i in range(0, c.gpus_per_node - 1, 2):
                _edge(g, f"{p}gpu{i}", f"{p}gpu{i + 1}", nv_bw, nv_lat, "nvlink")
        elif c.intra_node == "xgmi":  # a full mesh: one Infinity Fabric link per pair, no switch
            for i in range(c.gpus_per_node):
                for j in range(i + 1, c.gpus_per_node):
                    _edge(g, f"{p}gpu{i}", f"{p}gpu{j}", label_gbytes_per_s("XGMI", c.gpu), LATENCY_S["XGMI"],
                          "xgmi")
    _add_nics(g, c, p)
    return g


@lru_cache(maxsize=16)
def cluster_graph(c) -> Graph:
    """Every node, each NIC on its group's leaf switch, leaves under one spine (fat tree)."""
    g = Graph()
    for k in range(c.n_nodes):
        g.update(node_graph(c, k))
        leaf = f"leaf{k // c.nodes_per_leaf}"
        for j in range(c.nics_per_node):
            _edge(g, f"n{k}/nic{j}", leaf, c.nic_gbytes_per_s, NET_HOP_LATENCY_S / 2, "net")
    leaves = -(-c.n_nodes // c.nodes_per_leaf)
    if leaves > 1:
        uplink = c.nodes_per_leaf * c.nics_per_node * c.nic_gbytes_per_s / c.inter_node_oversubscription
        for leaf in range(leaves):
            _edge(g, f"leaf{leaf}", "spine", uplink, SPINE_EXTRA_LATENCY_S / 2, "net")
    return g


def widest_path(g: Graph, a: str, b: str, max_transit: int = 0) -> tuple[float, float, list[str]]:
    """(bottleneck GB/s, latency s, path) of the path with the most bandwidth; ties go to the lower latency.

    See `widest_paths_from` for the rules of a path.
    """
    found = widest_paths_from(g, a, max_transit).get(b)
    if found is None:
        raise TopologyError(f"no path from {a} to {b} in the cluster's graph: check the topology's links")
    return found


def widest_paths_from(g: Graph, a: str, max_transit: int = 0) -> dict[str, tuple[float, float, list[str]]]:
    """The widest path from `a` to every vertex it reaches: {vertex: (bottleneck GB/s, latency s, path)}.

    A max-bottleneck Dijkstra: a path's key is (-min bandwidth, latency sum).
    A NIC is not a shortcut between two devices of its node: a path may only
    cross it between the node and the fabric. A GPU forwards nothing by
    itself: a path passes through at most `max_transit` other GPUs (0 between
    two GPUs; 1 from a GPU to a NIC, NCCL's PXN: NVLink to a peer nearer the
    NIC).
    """
    best = {(a, False, 0): (-math.inf, 0.0)}
    heap = [(-math.inf, 0.0, a, False, 0, [a])]
    out: dict[str, tuple[float, float, list[str]]] = {}
    while heap:
        neg_bw, lat, v, via_net, hops, path = heapq.heappop(heap)
        if (neg_bw, lat) > best[(v, via_net, hops)]:
            continue
        if v not in out:
            out[v] = (-neg_bw, lat, path)
        kind = g.nodes[v].get("kind")
        if v != a and kind in ("gpu", "cpu-rank"):
            if hops == max_transit:
                continue
            hops += 1
        at_nic = kind == "nic" and v != a
        for w, e in g[v].items():
            to_net = e["kind"] == "net"
            if at_nic and to_net == via_net:
                continue
            key = (max(neg_bw, -e["gbytes_per_s"]), lat + e["latency_s"])
            if key < best.get((w, to_net, hops), (math.inf, math.inf)):
                best[(w, to_net, hops)] = key
                heapq.heappush(heap, (*key, w, to_net, hops, path + [w]))
    return out


def path_label(g: Graph, path: list[str], nvlink_links: int) -> str:
    """The label nvidia-smi would print for a GPU pair joined by `path`."""
    kinds = [g.edges[u, v]["kind"] for u, v in zip(path[:-1], path[1:], strict=True)]
    if kinds and all(k == "nvlink" for k in kinds):
        return f"NV{nvlink_links or 1}"
    if kinds == ["xgmi"]:
        return "XGMI"
    if all(k == "shm" for k in kinds):
        return "SHM"
    if kinds == ["measured"]:
        return g.edges[path[0], path[1]]["level"]
    levels = [g.edges[u, v]["level"] for u, v in zip(path[:-1], path[1:], strict=True)]
    return max((lv for lv in levels if lv in _LEVEL_ORDER), key=_LEVEL_ORDER.__getitem__)


def rank_path(c, rank_a: int, rank_b: int) -> tuple[float, float, list[str]]:
    """Bottleneck bandwidth, latency and vertices between two global ranks, read off the graph.

    Two ranks of one node talk inside it: a loop out through one NIC and back
    through another is not how a node's GPUs peer.
    """
    g = c.gpus_per_node
    node_a, node_b = rank_a // g, rank_b // g
    if node_a == node_b:
        return widest_path(_node_graph(c, node_a), gpu_vertex(node_a, rank_a % g), gpu_vertex(node_b, rank_b % g))
    # across nodes each side may reach its NIC through one peer GPU (PXN)
    return widest_path(cluster_graph(c), gpu_vertex(node_a, rank_a % g), gpu_vertex(node_b, rank_b % g), 2)


@lru_cache(maxsize=64)
def _node_graph(c, node: int) -> Graph:
    return node_graph(c, node)


# ---- the tables the cost model reads: a cache of the graph, one per cluster --------------


class LinkTable(NamedTuple):
    """One node's pairwise labels, raw bandwidths (GB/s per direction) and latencies."""

    labels: tuple[tuple[str, ...], ...]
    gbytes_per_s: tuple[tuple[float, ...], ...]
    latency_s: tuple[tuple[float, ...], ...]


@lru_cache(maxsize=256)
def node_link_table(cluster) -> LinkTable:
    """Every GPU pair of a node: its widest path's label, bottleneck bandwidth and latency (nodes are alike)."""
    g, n = _node_graph(cluster, 0), cluster.gpus_per_node
    labels, bws, lats = [], [], []
    for i in range(n):
        reach = widest_paths_from(g, gpu_vertex(0, i))
        row = [reach[gpu_vertex(0, j)] if j != i else (0.0, 0.0, []) for j in range(n)]
        labels.append(tuple("X" if j == i else path_label(g, row[j][2], cluster.gpu.nvlink_links) for j in range(n)))
        bws.append(tuple(bw for bw, _, _ in row))
        lats.append(tuple(lat for _, lat, _ in row))
    return LinkTable(tuple(labels), tuple(bws), tuple(lats))


@lru_cache(maxsize=256)
def gpu_nic_paths(cluster) -> tuple[tuple[float, float], ...]:
    """(raw GB/s, latency s) from each GPU of a node to its rail NIC: the widest path in the node's graph.

    Either straight over PCIe, or first over NVLink to a peer nearer the NIC
    (NCCL's PXN); the widest wins, then the quickest. The NIC's edge carries
    its line rate, so the path is capped by it.
    """
    if cluster.nics_per_node == 0:
        return tuple((0.0, 0.0) for _ in range(cluster.gpus_per_node))
    g = _node_graph(cluster, 0)
    out = []
    for i in range(cluster.gpus_per_node):
        bw, lat, _ = widest_path(g, gpu_vertex(0, i), f"n0/nic{nic_of_gpu(cluster, i)}", 1)
        out.append((bw, lat))
    return tuple(out)


def nic_share_gbytes_per_s(cluster) -> float:
    """Raw fabric bandwidth per GPU when every GPU of the node talks across nodes at once.

    nics * line rate / gpus_per_node, capped by the slowest GPU-to-NIC path:
    the fair share a parallel group gets, since all groups of an axis
    communicate together in training.
    """
    per_gpu = cluster.nics_per_node * cluster.nic_gbytes_per_s / cluster.gpus_per_node
    return min([per_gpu] + [bw for bw, _ in gpu_nic_paths(cluster)])


def link_between(cluster, rank_a: int, rank_b: int) -> tuple[float, float]:
    """(raw GB/s per direction, latency s) of the uncontended path between two global ranks.

    Inside a node: the pair's widest path. Across nodes: GPU -> its NIC ->
    leaf (-> spine -> leaf) -> NIC -> GPU; the slowest piece sets the
    bandwidth, latencies add (what `rank_path` finds on the whole cluster's
    graph, read from the per-node cache). Oversubscription only bites when
    many nodes talk at once, so it is priced in the collective model's fair
    shares, not here.
    """
    world = cluster.world_size
    for r in (rank_a, rank_b):
        if not 0 <= r < world:
            raise TopologyError(f"rank {r} is outside cluster {cluster.name!r} of {world} ranks")
    if rank_a == rank_b:
        return float("inf"), 0.0
    g = cluster.gpus_per_node
    node_a, node_b = rank_a // g, rank_b // g
    if node_a == node_b:
        table = node_link_table(cluster)
        return table.gbytes_per_s[rank_a % g][rank_b % g], table.latency_s[rank_a % g][rank_b % g]
    paths = gpu_nic_paths(cluster)
    (bw_a, lat_a), (bw_b, lat_b) = paths[rank_a % g], paths[rank_b % g]
    lat = lat_a + lat_b + NET_HOP_LATENCY_S + (SPINE_EXTRA_LATENCY_S if crosses_spine(cluster, node_a, node_b) else 0.0)
    return min(bw_a, bw_b), lat
