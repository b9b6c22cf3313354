"""Communication of one training step, priced on the real rank groups of a layout.

Every collective runs on the groups the rank grid gives for its mesh axes
(`planner.layout.axis_groups`); of an axis' groups the slowest one sets the
pace (a TP group that crosses nodes pays inter-node bandwidth), so one
representative per distinct placement is priced and the maximum kept. Prices
come from `topologies.collectives.CollectiveModel` with the calibration's link
efficiencies and latency scale, times the calibration's `collective_scale` of
the operation (what a backend's own algorithms add to the ring model: gloo's on
CPU ranks); GPU time: the host's dispatch cost per call,
`collective_overhead_s`, and how much of it compute hides (`comm_overlap`)
are the caller's to place.

Volumes (b micro-batch, s sequence, h hidden, D compute-dtype bytes, G
gradient-dtype bytes, t = tp, m = b*s/cp tokens per rank):
  TP   2 points per layer forward, 2 backward (2 more under full recompute):
       all-reduce of m*h*D, or with SP all-gather + reduce-scatter of m*h*D
  CP   per layer forward cp - 1 ring steps sending K and V (2*m*kv*D/t),
       backward twice that; overlapped with the attention core (Transformer
       Engine's p2p ring; PyTorch's all-gather kind: planner.simulate.context)
  EP   per MoE layer a dispatch and a combine all-to-all of top_k*(m/t)*h*D per
       rank, forward and backward, on the expert-parallel groups of the
       expert grid (planner.layout: ranks etp apart); with etp > 1 the
       expert's tokens are all-gathered and its output reduce-scattered over
       the etp group; times over `all_to_all_efficiency`, or
       `all_to_all_net_efficiency` when an ep group leaves the node (NVLink domain)
  EDP  expert gradients reduce over the expert data-parallel groups, dense
       ones over dp
  PP   send/recv of m*h*D (/t with SP) per boundary, micro-batch and direction
  DP   ZeRO-0/1: all-reduce of the stage's gradients (P*G) over dp once per step;
       ZeRO-1 then all-gathers the updated parameters (P*D) over dp_shard
  FSDP ZeRO-2: reduce-scatter of each layer's gradient per micro-batch, the
       parameters all-gathered once per step; ZeRO-3: all-gather of each
       layer's parameters in forward and backward and a reduce-scatter of its
       gradient, every micro-batch, prefetched under the layer's compute;
       HSDP adds an all-reduce of the gradient shard over dp_replicate
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from planner.layout import MESH_AXES, Layout, expert_group_offsets
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import moe_fraction
from planner.simulate.offload import host_link_gbytes_per_s
from topologies.cluster import Cluster
from topologies.collectives import CollectiveModel
from topologies.errors import PlanError


@lru_cache(maxsize=32)
def _collective_model(cluster: Cluster, efficiency: tuple[tuple[str, float], ...], latency_scale: float
                      ) -> CollectiveModel:
    return CollectiveModel(cluster, efficiency=dict(efficiency), latency_scale=latency_scale)


@lru_cache(maxsize=32)
def _expert_prices(model: CollectiveModel) -> dict[tuple, float]:
    """Expert-group collective times on `model`, by (op, size, `expert_groups_key`), and the GroupShapes of each
    key's groups, by `expert_groups_key`; shared by every StepComm."""
    return {}


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Rank stride of each mesh axis: the product of the sizes after it (row-major, tp fastest)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@lru_cache(maxsize=4096)
def group_offsets(shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:
    """Ranks of a group of `axes` minus its smallest rank, ascending: rank 0's group of `axis_groups`.

    An axis of size n and stride t adds k * t, k < n; taken in mesh order
    (row-major) the sums come out ascending, as `axis_groups` lists a group.
    """
    if len(shape) != len(MESH_AXES) or not set(axes) <= set(MESH_AXES):
        raise PlanError(f"mesh shape {shape} and axes {axes} must follow the mesh axes {MESH_AXES}")
    offsets = np.zeros(1, dtype=np.int64)
    for axis, size, stride in zip(MESH_AXES, shape, _strides(shape), strict=True):
        if axis in axes and size > 1:
            offsets = np.add.outer(offsets, np.arange(size, dtype=np.int64) * stride).ravel()
    return tuple(offsets.tolist())


@lru_cache(maxsize=4096)
def representative_groups(shape: tuple[int, ...], axes: tuple[str, ...], gpus_per_node: int
                          ) -> tuple[tuple[int, ...], ...]:
    """One group per distinct node placement among the groups of `axes` (usually one or two).

    The groups of `axis_groups(shape, axes)` in order, keeping the first of
    each placement (the sorted ranks-per-node counts), computed from strides:
    a group is its smallest rank b plus `group_offsets`, and its ranks sit on
    nodes (b + o) // g = b // g + (b % g + o) // g, so its placement depends on
    b % g only. The smallest b of each residue comes from the other axes'
    strides (a coordinate k and k + g give the same residue, so k < g
    suffices): at most g candidates, each counted once, instead of every group.
    """
    g = gpus_per_node
    offsets = np.asarray(group_offsets(shape, axes), dtype=np.int64)
    smallest = {0: 0}  # residue b % g -> smallest group base b with it
    for axis, size, stride in zip(MESH_AXES, shape, _strides(shape), strict=True):
        if axis in axes or size == 1:
            continue
        nxt: dict[int, int] = {}
        for base in smallest.values():
            for k in range(min(size, g)):
                b = base + k * stride
                if b < nxt.get(b % g, b + 1):
                    nxt[b % g] = b
        smallest = nxt
    seen: dict[tuple[int, ...], int] = {}
    for base in sorted(smallest.values()):
        _, per_node = np.unique((base % g + offsets) // g, return_counts=True)
        seen.setdefault(tuple(sorted(per_node.tolist())), base)
    return tuple(tuple((base + offsets).tolist()) for base in seen.values())


def representative_expert_groups(shape: tuple[int, ...], ep: int, etp: int, kind: str, gpus_per_node: int
                                 ) -> tuple[tuple[int, ...], ...]:
    """One group per distinct node placement among the "ep", "etp" or "edp" groups of the expert grid.

    A group is its first rank plus fixed offsets, so (as in
    `representative_groups`) its placement depends on that rank modulo the
    node size only; the smallest first rank of each reachable residue is priced.
    The answer depends on the grid's shape only through what `_expert_groups`
    takes: the ranks of a replica's stage, and how many stages (and replicas)
    there are up to the node size (more add no residue); a 16,384-GPU search
    asks it for a few hundred distinct keys instead of every mesh.
    """
    return _expert_groups(*expert_groups_key(shape, ep, etp, kind, gpus_per_node))


def expert_groups_key(shape: tuple[int, ...], ep: int, etp: int, kind: str, gpus_per_node: int
                      ) -> tuple[int, int, int, int, int, str, int]:
    """The arguments of `_expert_groups` for a mesh: meshes with equal keys have the same representative groups."""
    pp, replicate, shard, cp, tp = shape
    g = gpus_per_node
    if kind == "edp":
        return shard * cp * tp, replicate, min(pp, g), ep, etp, kind, g
    return shard * cp * tp, 1, min(pp * replicate, g), ep, etp, kind, g


def expert_grid_key(shape: tuple[int, ...], ep: int, etp: int, gpus_per_node: int) -> tuple[int, int, int, int]:
    """What the "ep" and "etp" groups of `representative_expert_groups` depend on: meshes with equal keys have
    the same representative groups (the ranks of a stage replica, stage replicas up to the node size, ep, etp)."""
    pp, replicate, shard, cp, tp = shape
    return shard * cp * tp, min(pp * replicate, gpus_per_node), ep, etp


@lru_cache(maxsize=4096)
def _expert_groups(inner: int, replicate: int, outer: int, ep: int, etp: int, kind: str, g: int
                   ) -> tuple[tuple[int, ...], ...]:
    """`representative_expert_groups` of a grid with `inner` ranks per stage replica.

    "edp": `replicate` replicas and `outer` = min(pp, g) stages; "ep"/"etp":
    `outer` = min(pp * replicate, g) stage replicas (replicate is 1).
    """
    block = ep * etp
    # a first rank is a sum of per-coordinate terms, and its residue modulo g depends on each term's
    # residue only: keep the smallest term of each residue, then combine (at most g^3, usually a few)
    def terms(step: int, count: int) -> dict[int, int]:  # residue -> smallest k * step, k < count
        out: dict[int, int] = {}
        for k in range(min(count, g)):
            out.setdefault(k * step % g, k * step)
        return out

    if kind == "edp":
        offsets = np.add.outer(np.arange(replicate, dtype=np.int64) * inner,
                               np.arange(inner // block, dtype=np.int64) * block).ravel()
        parts = [terms(replicate * inner, outer), terms(1, block)]
    else:
        offsets = expert_group_offsets(ep, etp, kind)
        parts = [terms(inner, outer), terms(block, inner // block),
                 terms(1, etp) if kind == "ep" else terms(etp, ep)]
    smallest: dict[int, int] = {0: 0}
    for part in parts:
        nxt: dict[int, int] = {}
        for base in smallest.values():
            for value in part.values():
                b = base + value
                if b < nxt.get(b % g, b + 1):
                    nxt[b % g] = b
        smallest = nxt
    seen: dict[tuple[int, ...], int] = {}
    offs = np.asarray(offsets, dtype=np.int64)
    for base in sorted(smallest.values()):
        per_node = np.bincount((base % g + offs) // g)
        seen.setdefault(tuple(sorted(per_node[per_node > 0].tolist())), base)
    return tuple(tuple((base + offs).tolist()) for base in seen.values())


class StepComm:
    """Collective times of one layout on one cluster (the worst group of each axis)."""

    def __init__(self, cluster: Cluster, layout: Layout, cal: CalibrationProfile) -> None:
        self.model = _collective_model(cluster, tuple(sorted(cal.link_efficiency.items())), cal.latency_scale)
        self.shape = layout.mesh_shape
        self.gpus_per_node = cluster.gpus_per_node
        self.ep, self.etp = layout.ep, layout.etp
        self.all_to_all_efficiency = cal.all_to_all_efficiency
        self.all_to_all_net_efficiency = cal.all_to_all_net_efficiency
        self._ep_crosses_nodes: bool | None = None  # whether an ep group leaves its node (first all-to-all)
        self.cal = cal
        self._expert_times: dict[tuple[str, float, str], float] = {}
        self.host_link_gbytes_per_s = host_link_gbytes_per_s(cluster)  # host <-> GPU copies (offload)
        self.scale = cal.collective_scale

    def groups(self, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        return representative_groups(self.shape, axes, self.gpus_per_node)

    def time_s(self, op: str, size_bytes: float, axes: tuple[str, ...], limit: int = 0) -> float:
        """Worst time of `op` over the groups of `axes` (their first `limit` ranks when limit > 0)."""
        if size_bytes <= 0:
            return 0.0
        groups = self.groups(axes)
        if limit:
            groups = tuple(g[:limit] for g in groups)
        if len(groups[0]) < 2:
            return 0.0
        return max(self.model.time_s(op, size_bytes, g) for g in groups) * self.scale.get(op, 1.0)

    def pair_time_s(self, size_bytes: float, axes: tuple[str, ...], a: int, b: int) -> float:
        """send_recv between members a and b of the groups of `axes` (the worst such pair)."""
        if size_bytes <= 0 or a == b:
            return 0.0
        scale = self.scale.get("send_recv", 1.0)
        return max(self.model.time_s("send_recv", size_bytes, (g[a], g[b])) for g in self.groups(axes)) * scale

    # ---- per layer and micro-batch ---------------------------------------------

    def tp_point_s(self, act_bytes: float, sequence_parallel: bool) -> float:
        """One TP synchronisation point: all-reduce, or all-gather + reduce-scatter with SP."""
        if sequence_parallel:
            return self.time_s("all_gather", act_bytes, ("tp",)) + self.time_s("reduce_scatter", act_bytes, ("tp",))
        return self.time_s("all_reduce", act_bytes, ("tp",))

    def cp_ring_s(self, kv_bytes: float, cp: int) -> float:
        """cp - 1 ring steps of K and V between neighbours (the wrap-around hop is the slowest)."""
        return (cp - 1) * self.pair_time_s(kv_bytes, ("cp",), 0, cp - 1) if cp > 1 else 0.0

    def expert_time_s(self, op: str, size_bytes: float, kind: str) -> float:
        """Worst time of `op` over the expert grid's "ep", "etp" or "edp" groups (planner.layout)."""
        if size_bytes <= 0:
            return 0.0
        key = (op, size_bytes, kind)
        hit = self._expert_times.get(key)
        if hit is None:  # priced once per collective model for every mesh with the same groups
            shared = _expert_prices(self.model)
            groups_key = expert_groups_key(self.shape, self.ep, self.etp, kind, self.gpus_per_node)
            hit = shared.get((op, size_bytes, groups_key))
            if hit is None:
                shapes = shared.get(groups_key)  # the groups reduced to what prices them, once per key
                if shapes is None:
                    groups = _expert_groups(*groups_key)
                    shapes = shared[groups_key] = () if len(groups[0]) < 2 else \
                        tuple(self.model.group_shape(g) for g in groups)
                hit = max((self.model.shape_time_s(op, size_bytes, sh) for sh in shapes), default=0.0)
                shared[op, size_bytes, groups_key] = hit
            self._expert_times[key] = hit
        return hit

    def ep_all_to_all_s(self, size_bytes: float) -> float:
        """One dispatch or combine: all-to-all of each rank's routed tokens over its ep group, at the
        network's all-to-all efficiency when any ep group spans nodes (NVLink domains)."""
        if self._ep_crosses_nodes is None:
            groups = representative_expert_groups(self.shape, self.ep, self.etp, "ep", self.gpus_per_node)
            self._ep_crosses_nodes = any(len({r // self.gpus_per_node for r in group}) > 1 for group in groups)
        efficiency = self.all_to_all_net_efficiency if self._ep_crosses_nodes else self.all_to_all_efficiency
        return self.expert_time_s("all_to_all", size_bytes, "ep") / efficiency


def collective_time_s(comm: StepComm, c) -> float:
    """`c.count` collectives of a `planner.simulate.collectives.Collective` entry, on its worst group."""
    if c.axes == ("edp",):
        return c.count * comm.expert_time_s(c.kind, c.size_bytes, "edp")
    return c.count * comm.time_s(c.kind, c.size_bytes, c.axes)


def expert_comm_s(model: ModelSpec, layout: Layout, comm: StepComm, act_bytes: float) -> tuple[float, int]:
    """Exposed expert communication of an average layer's pass and the collectives it issues.

    A MoE layer's rank routes its m/tp tokens (sequence parallel) to top_k
    experts: dispatch and combine all-to-alls over the ep group, and with
    etp > 1 an all-gather of the received tokens and a reduce-scatter of the
    experts' output over the etp group. The imbalance calibration scales the
    volume of the busiest rank. Dense layers of the model have none, so the
    average layer pays `moe_fraction` of it.
    """
    f = moe_fraction(model)
    routed = act_bytes / layout.tp * model.moe.top_k * _comm_imbalance(model, comm)
    total = 2 * comm.ep_all_to_all_s(routed) if layout.ep > 1 else 0.0
    if layout.etp > 1:
        total += comm.expert_time_s("all_gather", routed * layout.etp, "etp") + \
            comm.expert_time_s("reduce_scatter", routed * layout.etp, "etp")
    return f * total, (2 if layout.ep > 1 else 0) + (2 if layout.etp > 1 else 0)


def _comm_imbalance(model: ModelSpec, comm: StepComm) -> float:
    moe = model.moe
    imbalance = comm.cal.moe_imbalance
    return min(imbalance, moe.capacity_factor) if moe.capacity_factor else imbalance
