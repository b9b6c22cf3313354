"""Links between GPUs: the labels `nvidia-smi topo -m` prints, and what each one costs.

Inside a node a GPU pair is joined by one link class, named as nvidia-smi
names it: NV<k> (k NVLink links, direct or through an NVSwitch), PIX (one PCIe
switch), PXB (several switches, no host bridge), PHB (through a PCIe host
bridge), NODE (between host bridges of one NUMA node), SYS (across the CPU
socket interconnect), XGMI (AMD Infinity Fabric: one direct link per GPU pair, as `rocm-smi
--showtopo` names it), and SHM for CPU ranks sharing one host. Between nodes a
GPU reaches the fabric through its NIC (rail-aligned: GPU i uses NIC
i * nics / gpus).

These are the facts of one link class. What a pair of GPUs or a GPU and
its NIC actually get is read off the cluster's graph (`topologies.graph`:
the widest path through NVSwitch, PCIe switches, host bridges, NICs and the
fabric), which is built from these prices.

Raw bandwidths are per direction, in 1e9 bytes/s, the physical bottleneck of
the path; latencies are one-way per hop as NCCL's low-latency protocol sees
them. `EFFICIENCY` is the share of the raw bandwidth a collective reaches on
each class (the efficiencies and latencies are model parameters: see the
comments for the measurements they come from).
"""

from __future__ import annotations

import re

from topologies.errors import TopologyError

PCIE_LABELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_NV = re.compile(r"^NV(\d+)$")

# Share of the PCIe x16 payload rate a GPU pair gets, by how far apart they are.
# Through one or more switches P2P runs at the link rate; through a host bridge
# or between root complexes the CPU's fabric costs some; across sockets NCCL
# stages through host memory (P2P over SYS is off by default). Without P2P
# (GeForce) every PCIe pair bounces through host memory: two copies.
PCIE_SHARE = {"PIX": 1.0, "PXB": 1.0, "PHB": 0.9, "NODE": 0.8, "SYS": 0.5}
NO_P2P_SHARE = 0.5
# An xGMI hop is priced as an NVLink hop: one direct SerDes link, no measurement of its own here.
LATENCY_S = {"NV": 0.7e-6, "XGMI": 0.7e-6, "PIX": 1.2e-6, "PXB": 1.4e-6, "PHB": 1.6e-6, "NODE": 2.0e-6, "SYS": 2.8e-6,
             "SHM": 10e-6}
NET_HOP_LATENCY_S = 2.0e-6  # NIC -> leaf switch -> NIC (InfiniBand/RoCE); the PCIe legs to the NICs add theirs
SPINE_EXTRA_LATENCY_S = 1.0e-6  # two more switch traversals when a path climbs to the spine
# gloo over shared memory/loopback on one host: copy-bound, a few GB/s per rank pair.
HOST_SHM_GBYTES_PER_S = 5.0

# Achieved share of the raw bandwidth, by link class (defaults; a calibration may override).
EFFICIENCY = {
    # NCCL's protocol overhead on NVLink is ~20%: nccl-tests all_reduce on 8x A100 SXM reaches
    # 232.5 GB/s busbw over 300 GB/s NVLink3 (NVIDIA/nccl-tests#175); rings on H100 ~370 of 450
    # (NVIDIA/nccl-tests#212).
    "nvlink": 0.8,
    # NVLink SHARP (in-switch reduction, H100 and later): all_reduce moves S per direction instead of
    # 2(n-1)/n S. 8x H100 peaks at ~480 GB/s busbw = ~275 GB/s algbw of 450 (NVIDIA/nccl-tests#212).
    "nvls": 0.6,
    # xGMI on MI300X: 64 GB/s per link and direction rated, ~48 usable after CRC and protocol overhead
    # (AMD ROCm blog "Understanding RCCL Bandwidth and xGMI Performance on AMD Instinct MI300X", 2025).
    "xgmi": 0.75,
    "pcie": 0.9,  # P2P copies over PCIe switches reach ~90% of the payload rate
    # ConnectX-6/7 InfiniBand: NCCL reaches ~24 of 25 GB/s per HDR NIC (NVIDIA/nccl#412) and
    # 48-49 of 50 GB/s per NDR NIC (NVIDIA/nccl-tests#267).
    "net": 0.96,
    "shm": 1.0,
    # NCCL's own tuner discounts tree bandwidth by 0.9 and NVLS-tree by 0.7 (src/graph/tuning.cc).
    "tree": 0.9,
    "nvls_tree": 0.7,
}


def check_label(label: str, diagonal: bool = False) -> None:
    """Reject a link label meshplan cannot price, naming the accepted ones."""
    if diagonal:
        if label != "X":
            raise TopologyError(f"GPU link matrix: the diagonal must be 'X', got {label!r}")
        return
    if label in PCIE_LABELS or label in ("SHM", "XGMI") or _NV.match(label):
        return
    raise TopologyError(
        f"GPU link label {label!r} is unknown; use NV<links>, XGMI, {', '.join(PCIE_LABELS)} or SHM"
    )


def link_class(label: str) -> str:
    """The efficiency class of a label: nvlink, xgmi, pcie or shm."""
    if _NV.match(label):
        return "nvlink"
    return {"SHM": "shm", "XGMI": "xgmi"}.get(label, "pcie")


def derive_labels(cluster) -> tuple[tuple[str, ...], ...]:
    """The node's GPU x GPU label matrix: measured (`gpu_links`) or derived from the preset's structure."""
    if cluster.gpu_links:
        return cluster.gpu_links
    n = cluster.gpus_per_node
    return tuple(tuple("X" if i == j else _pair_label(cluster, i, j) for j in range(n)) for i in range(n))


def _pair_label(cluster, i: int, j: int) -> str:
    nv = f"NV{cluster.gpu.nvlink_links or 1}"
    if cluster.intra_node == "host":
        return "SHM"
    if cluster.intra_node == "xgmi":
        return "XGMI"
    if cluster.intra_node == "nvswitch" or (cluster.nvlink_bridge_pairs and i // 2 == j // 2):
        return nv
    return pcie_label(cluster, i, j)


def pcie_label(cluster, i: int, j: int) -> str:
    """PIX/PXB/NODE/SYS from the PCIe group sizes (GPU index order); PHB is only ever measured."""
    switch = cluster.gpus_per_pcie_switch
    root = cluster.gpus_per_pcie_root or switch
    numa = cluster.gpus_per_numa_node or cluster.gpus_per_node
    if i // switch == j // switch:
        return "PIX"
    if i // root == j // root:
        return "PXB"
    return "NODE" if i // numa == j // numa else "SYS"


def label_gbytes_per_s(label: str, gpu) -> float:
    """Raw bandwidth per direction of one GPU pair joined by `label`."""
    m = _NV.match(label)
    if m:
        links = int(m.group(1))
        per_link = gpu.nvlink_link_gbytes_per_s or gpu.nvlink_gbytes_per_s / max(links, 1)
        return min(links * per_link, gpu.nvlink_gbytes_per_s) if gpu.nvlink_gbytes_per_s else 0.0
    if label == "SHM":
        return HOST_SHM_GBYTES_PER_S
    if label == "XGMI":
        return gpu.xgmi_link_gbytes_per_s
    share = PCIE_SHARE[label] if gpu.pcie_p2p else min(PCIE_SHARE[label], NO_P2P_SHARE)
    return share * gpu.pcie_gbytes_per_s


def label_latency_s(label: str) -> float:
    return LATENCY_S["NV"] if _NV.match(label) else LATENCY_S[label]


def full_mesh(labels: tuple[tuple[str, ...], ...], pattern: tuple[int, ...]) -> bool:
    """Every pair of `pattern` (local GPU indices) has its own direct xGMI link: a collective over
    them can drive k - 1 links of each GPU at once, as RCCL's rings on a fully connected node do."""
    return len(pattern) > 1 and all(labels[a][b] == "XGMI" for a in pattern for b in pattern if a != b)


def nic_of_gpu(cluster, gpu: int) -> int:
    """Rail alignment: GPU i uses NIC i * nics // gpus (NIC i when there are as many NICs as GPUs)."""
    return gpu * cluster.nics_per_node // cluster.gpus_per_node


def nic_anchor_gpu(cluster, nic: int) -> int:
    """The GPU whose PCIe switch hosts NIC j (NICs spread evenly over the GPUs' switches)."""
    return nic * cluster.gpus_per_node // cluster.nics_per_node


def nic_label(cluster, gpu: int, nic: int) -> str:
    """How GPU i reaches NIC j over PCIe, in nvidia-smi's words (a NIC sits beside its anchor GPU)."""
    if cluster.gpu_nic_links:
        return cluster.gpu_nic_links[gpu][nic]
    if cluster.intra_node == "host":
        return "SHM"
    anchor = nic_anchor_gpu(cluster, nic)
    switch = cluster.gpus_per_pcie_switch
    return "PIX" if gpu // switch == anchor // switch else pcie_label(cluster, gpu, anchor)


def crosses_spine(cluster, node_a: int, node_b: int) -> bool:
    return node_a // cluster.nodes_per_leaf != node_b // cluster.nodes_per_leaf
