"""Collective cost model: how long collective X of S bytes takes over rank group G on cluster C.

Alpha-beta: time = launch + steps * hop latency + bytes on the busiest link /
its effective bandwidth. Each algorithm NCCL could pick is priced and the
fastest wins, as NCCL's tuner would choose:

- ring: n-1 steps for all-gather/reduce-scatter, 2(n-1) for all-reduce; each
  rank moves (n-1)/n S (twice for all-reduce) over the slowest ring hop. On a
  full mesh of direct links (AMD xGMI) k GPUs of a node run k-1 rings at once,
  one per link of each GPU, so the hop carries (k-1) links' bandwidth.
  Across nodes the ring leaves each node once per channel, so a node's share
  of the fabric carries one ring's traffic: bus bandwidth = min(in-node hop,
  ranks-per-node * per-GPU NIC share / oversubscription).
- tree (across nodes): chain in the node, double binary tree between nodes,
  pipelined; latency grows with log2(nodes) instead of n. Each GPU of the
  chain sends S up and S down; each node sends S (two nodes) or 2S (more) to
  the fabric, which is why two-node trees beat rings (NVIDIA/nccl#812).
- nvls (NVSwitch with NVLink4+, one node): the switch reduces, so each GPU
  sends and receives S once: time = S / (NVLink * nvls efficiency).
- nvls_tree (NVLS inside nodes, tree between them), pipelined.
- hierarchical (across nodes): ring reduce-scatter inside the node, all-reduce
  of S/k between nodes on each of the k rails, ring all-gather inside the
  node, one after the other.

Sizes follow nccl-tests: all_reduce and broadcast the buffer, all_gather and
reduce_scatter the FULL gathered buffer, all_to_all the per-rank send buffer,
send_recv the message. Groups are global ranks; a rank lives on node
rank // gpus_per_node. Bandwidths are fair shares: every group of an axis is
assumed to communicate at the same time, as DP and TP groups do in training.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple

from topologies.cluster import Cluster
from topologies.errors import TopologyError
from topologies.graph import LinkTable, gpu_nic_paths, link_between, nic_share_gbytes_per_s, node_link_table
from topologies.links import (
    EFFICIENCY,
    NET_HOP_LATENCY_S,
    SPINE_EXTRA_LATENCY_S,
    crosses_spine,
    full_mesh,
    link_class,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
_ALIASES = {"sendrecv": "send_recv", "allreduce": "all_reduce", "allgather": "all_gather",
            "reducescatter": "reduce_scatter", "alltoall": "all_to_all", "p2p": "send_recv"}
LAUNCH_S = {"nccl": 5e-6, "gloo": 30e-6}  # fixed cost of one collective call (kernel launch, sync)
MAX_RING_SEARCH = 8  # GPUs per node up to which every ring order is tried (7! = 5040 orders)
PEER_ISSUE_S = 0.2e-6  # all_to_all: posting one send/recv pair per peer
_CACHE_LIMIT = 200_000

__all__ = ["OPS", "CollectiveModel", "GroupShape", "bus_bandwidth_gbytes_per_s", "busbw_factor",
           "collective_model", "collective_time_s", "link_between", "normalize_op"]


def normalize_op(op: str) -> str:
    key = op.strip().lower().replace("-", "_")
    key = _ALIASES.get(key.replace("_", ""), key)
    if key not in OPS:
        raise TopologyError(f"unknown collective {op!r}; use one of {', '.join(OPS)}")
    return key


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: 2(n-1)/n all-reduce, (n-1)/n gather/scatter/all-to-all, else 1."""
    op = normalize_op(op)
    if n <= 1:
        return 0.0 if op != "send_recv" else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def bus_bandwidth_gbytes_per_s(op: str, n: int, size_bytes: float, time_s: float) -> float:
    """busbw = algbw * busbw_factor, algbw = size / time (nccl-tests, PERFORMANCE.md)."""
    if time_s <= 0:
        return 0.0
    return size_bytes / time_s / 1e9 * busbw_factor(op, n)


class GroupShape(NamedTuple):
    """What a group's cost depends on; groups of equal shape cost the same."""

    n: int  # ranks
    n_nodes: int  # nodes spanned
    min_per_node: int  # fewest group ranks on one node (sets the node's fabric share)
    max_per_node: int
    ring_gbytes_per_s: float  # effective slowest hop of the in-node ring (inf: one rank per node)
    ring_latency_s: float
    pair_gbytes_per_s: float  # effective slowest pair in a node (all-to-all)
    spine: bool  # spans more than one leaf switch


class CollectiveModel:
    """Collective times for one cluster, memoized by (op, size, group shape).

    `efficiency` overrides EFFICIENCY per link class (nvlink, nvls, pcie, net,
    shm) and `latency_scale` scales every latency: the knobs a calibration fits.
    """

    def __init__(self, cluster: Cluster, efficiency: Mapping[str, float] | None = None,
                 latency_scale: float = 1.0) -> None:
        self.cluster = cluster
        self.eff = {**EFFICIENCY, **(efficiency or {})}
        self.latency_scale = latency_scale
        table = node_link_table(cluster)
        self._bw = [[bw * self.eff[link_class(lab)] if lab != "X" else math.inf
                     for lab, bw in zip(lrow, brow, strict=True)]
                    for lrow, brow in zip(table.labels, table.gbytes_per_s, strict=True)]
        self._lat = [[lat * latency_scale for lat in row] for row in table.latency_s]
        self._net_gbytes_per_s = nic_share_gbytes_per_s(cluster) * self.eff["net"]
        # one fabric hop: the slowest GPU -> NIC leg on each side plus the NIC -> leaf -> NIC hop
        self._net_lat = 2 * max(lat for _, lat in gpu_nic_paths(cluster)) + NET_HOP_LATENCY_S
        self._launch_s = LAUNCH_S["gloo" if cluster.intra_node == "host" else "nccl"] * latency_scale
        self._nvls = cluster.intra_node == "nvswitch" and cluster.gpu.nvlink_gen >= 4
        self._shapes: dict[tuple[int, ...], GroupShape] = {}
        self._times: dict[tuple, float] = {}
        self._patterns: dict[tuple[tuple[int, ...], bool], tuple[float, float, float]] = {}

    # ---- public -----------------------------------------------------------

    def time_s(self, op: str, size_bytes: float, ranks: Sequence[int]) -> float:
        """Seconds for `op` on `size_bytes` over the group `ranks` (the fastest algorithm)."""
        key = ranks if type(ranks) is tuple else tuple(ranks)
        shape = self._shapes.get(key) or self._group_shape(key)
        tkey = (op, size_bytes, shape)
        t = self._times.get(tkey)
        if t is None:
            t = self._store(self._times, tkey, min(self.algorithms(op, size_bytes, key).values()))
        return t

    def group_shape(self, ranks: Sequence[int]) -> GroupShape:
        """What the time of a collective on `ranks` depends on (cached): price it with `shape_time_s`."""
        return self._group_shape(ranks if type(ranks) is tuple else tuple(ranks))

    def shape_time_s(self, op: str, size_bytes: float, shape: GroupShape) -> float:
        """`time_s` of a group given by its `group_shape`: callers that price one large group at many sizes
        skip hashing its ranks every time."""
        tkey = (op, size_bytes, shape)
        t = self._times.get(tkey)
        if t is None:
            t = self._store(self._times, tkey, min(self._priced(op, size_bytes, shape).values()))
        return t

    def algorithms(self, op: str, size_bytes: float, ranks: Sequence[int]) -> dict[str, float]:
        """Time of every algorithm that applies, by name (ring, tree, nvls, hierarchical, direct)."""
        return self._priced(op, size_bytes, self._group_shape(tuple(ranks)))

    def _priced(self, op: str, size_bytes: float, shape: GroupShape) -> dict[str, float]:
        op = normalize_op(op)
        if size_bytes < 0:
            raise TopologyError(f"collective size must be >= 0 bytes, got {size_bytes}")
        if shape.n == 1:
            return {"none": 0.0}
        return _PRICERS[op](self, float(size_bytes), shape)

    def _group_shape(self, ranks: tuple[int, ...]) -> GroupShape:
        shape = self._shapes.get(ranks)
        return shape if shape is not None else self._store(self._shapes, ranks, self.shape(ranks))

    def shape(self, ranks: tuple[int, ...]) -> GroupShape:
        """Reduce a group to what its cost depends on (computed, not cached: see _group_shape)."""
        c = self.cluster
        g, n = c.gpus_per_node, len(ranks)
        if n == 0:
            raise TopologyError("a collective needs at least one rank")
        if len(set(ranks)) != n or min(ranks) < 0 or max(ranks) >= c.world_size:
            raise TopologyError(
                f"rank group {list(ranks)[:16]} must hold distinct ranks in 0..{c.world_size - 1} "
                f"(cluster {c.name!r}: {c.n_nodes} nodes x {g} GPUs)"
            )
        local: dict[int, list[int]] = {}
        for r in ranks:
            local.setdefault(r // g, []).append(r % g)
        counts = [len(v) for v in local.values()]
        ring_bw, ring_lat, pair_bw = math.inf, 0.0, math.inf
        for pattern in {tuple(sorted(v)) for v in local.values()}:
            pkey = (pattern, len(local) == 1)
            cost = self._patterns.get(pkey)
            if cost is None:
                cost = self._patterns[pkey] = self._pattern_cost(*pkey)
            bw, lat, pbw = cost
            ring_bw, ring_lat, pair_bw = min(ring_bw, bw), max(ring_lat, lat), min(pair_bw, pbw)
        nodes = sorted(local)
        return GroupShape(n, len(local), min(counts), max(counts), ring_bw, ring_lat, pair_bw,
                          crosses_spine(c, nodes[0], nodes[-1]))

    # ---- pieces -----------------------------------------------------------

    def _pattern_cost(self, pattern: tuple[int, ...], closed: bool) -> tuple[float, float, float]:
        """Slowest hop (bandwidth, latency) of the best in-node ring, and the slowest pair.

        A ring in index order is best on every preset; a measured node (e.g. a
        DGX-1 hybrid cube mesh) may need another order, which NCCL's ring
        search finds: up to MAX_RING_SEARCH GPUs we try every order. Across
        nodes the ring runs through the node as a chain; we price the chain
        like the ring (a chain is never slower).
        """
        pairs = [(a, b) for a in pattern for b in pattern if a != b]
        pair = min((self._bw[a][b] for a, b in pairs), default=math.inf)
        if full_mesh(node_link_table(self.cluster).labels, pattern):
            # k GPUs joined pair by pair (xGMI): k - 1 rings run at once, each over other links, and an
            # all-to-all sends to every peer on its own link, so a GPU moves data on k - 1 links together
            links = len(pattern) - 1
            lat = max(self._lat[a][b] for a, b in pairs)
            return pair * links, lat, pair * links
        best_order = pattern
        if len(pattern) > 2 and pair < max(self._bw[a][b] for a, b in pairs):
            best_order = best_ring_order(node_link_table(self.cluster), pattern)
        hops = list(zip(best_order, best_order[1:] + best_order[:1], strict=True))
        if not closed or len(pattern) == 2:
            hops = hops[:-1]
        bw = min((self._bw[a][b] for a, b in hops), default=math.inf)
        lat = max((self._lat[a][b] for a, b in hops), default=0.0)
        return bw, lat, pair

    def _net(self, shape: GroupShape, per_rank: bool = False) -> tuple[float, float]:
        """(effective GB/s, latency) of the fabric: the node's share for the group, or one rank's."""
        over = self.cluster.inter_node_oversubscription if shape.spine else 1.0
        ranks = 1 if per_rank else shape.min_per_node
        lat = self._net_lat + (SPINE_EXTRA_LATENCY_S if shape.spine else 0.0)
        return ranks * self._net_gbytes_per_s / over, lat * self.latency_scale

    def _ring(self, shape: GroupShape) -> tuple[float, float]:
        """(bus GB/s, per-step latency) of a ring over the whole group."""
        bw, lat = shape.ring_gbytes_per_s, shape.ring_latency_s
        if shape.n_nodes > 1:
            net_bw, net_lat = self._net(shape)
            bw, lat = min(bw, net_bw), max(lat, net_lat)
        return bw, lat

    def _store(self, cache: dict, key, value):
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = value
        return value


@lru_cache(maxsize=1024)
def best_ring_order(table: LinkTable, pattern: tuple[int, ...]) -> tuple[int, ...]:
    """The ring order over `pattern` (local GPU indices) with the widest slowest hop, then the lowest
    worst latency, on raw link bandwidths. Index order beyond MAX_RING_SEARCH GPUs."""
    if len(pattern) > MAX_RING_SEARCH:
        return pattern
    bw, lat = table.gbytes_per_s, table.latency_s
    best, best_key = pattern, None
    for perm in itertools.permutations(pattern[1:]):
        order = (pattern[0], *perm)
        hops = list(zip(order, order[1:] + order[:1], strict=True))
        key = (min(bw[a][b] for a, b in hops), -max(lat[a][b] for a, b in hops))
        if best_key is None or key > best_key:
            best, best_key = order, key
    return best


# ---- pricers: op -> {algorithm: seconds} ------------------------------------


def _tree_depth(shape: GroupShape, net_lat: float) -> float:
    """One-way latency down a tree: chain inside the node, binary tree between nodes."""
    return (shape.max_per_node - 1) * shape.ring_latency_s + math.ceil(math.log2(shape.n_nodes)) * net_lat


def _tree_net_bytes(size: float, nodes: int) -> float:
    """Bytes a node sends to the fabric in a double-binary-tree all-reduce of `size`.

    With two nodes each is a leaf of one tree and the root of the other: S.
    With more, every node is interior in one tree (receives two halves, sends
    one up, then two down) and a leaf in the other: 2S.
    """
    return size if nodes == 2 else 2 * size


def _all_reduce(m: CollectiveModel, size: float, s: GroupShape) -> dict[str, float]:
    n, base = s.n, m._launch_s
    bw, lat = m._ring(s)
    out = {"ring": base + 2 * (n - 1) * lat + 2 * (n - 1) / n * size / bw / 1e9}
    nvls_bw = m.cluster.gpu.nvlink_gbytes_per_s * m.eff["nvls"]
    if s.n_nodes == 1:
        if m._nvls:
            out["nvls"] = base + 2 * s.ring_latency_s + size / nvls_bw / 1e9
        return out
    net_bw, net_lat = m._net(s)
    tree_lat = base + 2 * _tree_depth(s, net_lat)
    net_s = _tree_net_bytes(size, s.n_nodes) / net_bw / 1e9
    chain_s = 2 * size / s.ring_gbytes_per_s / 1e9  # each GPU sends S up (reduce) and S down (broadcast)
    out["tree"] = tree_lat + max(chain_s, net_s) / m.eff["tree"]
    if m._nvls and s.min_per_node > 1:
        out["nvls_tree"] = tree_lat + max(size / nvls_bw / 1e9, net_s / m.eff["nvls_tree"])
    if s.min_per_node > 1:
        out["hierarchical"] = base + _intra_rs_ag(size, s) + _rail_all_reduce(m, size / s.min_per_node, s)
    return out


def _intra_rs_ag(size: float, s: GroupShape) -> float:
    """In-node ring reduce-scatter then all-gather of `size` over the group's k ranks per node."""
    k = s.max_per_node
    return 2 * ((k - 1) * s.ring_latency_s + (k - 1) / k * size / s.ring_gbytes_per_s / 1e9)


def _rail_all_reduce(m: CollectiveModel, size: float, s: GroupShape) -> float:
    """All-reduce of `size` between nodes on one rail (one rank per node), ring or tree."""
    bw, lat = m._net(s, per_rank=True)
    nodes = s.n_nodes
    ring = 2 * (nodes - 1) * lat + 2 * (nodes - 1) / nodes * size / bw / 1e9
    tree = 2 * math.ceil(math.log2(nodes)) * lat + _tree_net_bytes(size, nodes) / (bw * m.eff["tree"]) / 1e9
    return min(ring, tree)


def _gather_like(m: CollectiveModel, size: float, s: GroupShape) -> dict[str, float]:
    """all_gather and reduce_scatter of the full buffer `size` (same traffic, reversed)."""
    n, base = s.n, m._launch_s
    bw, lat = m._ring(s)
    out = {"ring": base + (n - 1) * lat + (n - 1) / n * size / bw / 1e9}
    if s.n_nodes > 1 and s.min_per_node > 1:
        k, nodes = s.min_per_node, s.n_nodes
        rail_bw, rail_lat = m._net(s, per_rank=True)
        inter = (nodes - 1) * rail_lat + (nodes - 1) / nodes * size / k / rail_bw / 1e9
        intra = (k - 1) * s.ring_latency_s + (k - 1) / k * size / s.ring_gbytes_per_s / 1e9
        out["hierarchical"] = base + inter + intra
    return out


def _broadcast(m: CollectiveModel, size: float, s: GroupShape) -> dict[str, float]:
    bw, lat = m._ring(s)
    out = {"ring": m._launch_s + (s.n - 1) * lat + size / bw / 1e9}
    if s.n_nodes > 1:
        out["tree"] = m._launch_s + _tree_depth(s, m._net(s)[1]) + size / bw / 1e9
    return out


def _all_to_all(m: CollectiveModel, size: float, s: GroupShape) -> dict[str, float]:
    """Every rank sends size/n to each peer: in-node bytes over the slowest pair, the rest over its NIC share."""
    n = s.n
    intra = (s.max_per_node - 1) / n * size / s.pair_gbytes_per_s / 1e9 if s.max_per_node > 1 else 0.0
    lat = s.ring_latency_s
    inter = 0.0
    if s.n_nodes > 1:
        net_bw, net_lat = m._net(s, per_rank=True)
        inter, lat = (n - s.min_per_node) / n * size / net_bw / 1e9, max(lat, net_lat)
    return {"direct": m._launch_s + lat + (n - 1) * PEER_ISSUE_S * m.latency_scale + max(intra, inter)}


def _send_recv(m: CollectiveModel, size: float, s: GroupShape) -> dict[str, float]:
    if s.n != 2:
        raise TopologyError(f"send_recv is between 2 ranks, got a group of {s.n}")
    bw, lat = m._ring(s)
    return {"direct": m._launch_s + lat + size / bw / 1e9}


_PRICERS = {"all_reduce": _all_reduce, "all_gather": _gather_like, "reduce_scatter": _gather_like,
            "broadcast": _broadcast, "all_to_all": _all_to_all, "send_recv": _send_recv}


@lru_cache(maxsize=64)
def collective_model(cluster: Cluster) -> CollectiveModel:
    """The shared, memoized model of a cluster with default efficiencies (one per cluster per process)."""
    return CollectiveModel(cluster)


def collective_time_s(cluster: Cluster, op: str, size_bytes: float, ranks: Sequence[int]) -> float:
    """Seconds for collective `op` of `size_bytes` (nccl-tests sizes) over global `ranks` on `cluster`."""
    return collective_model(cluster).time_s(normalize_op(op), size_bytes, ranks)
