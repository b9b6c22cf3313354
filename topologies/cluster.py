"""Cluster: where a job runs. A resolved, frozen description of nodes, GPUs and links.

A Cluster never knows the model it will run. Presets (TOML files under
`topologies/presets/`), custom TOML files and `--set KEY=VALUE` what-ifs are
resolved into one of these at the edge, by `load_cluster`.

Inside a node the GPUs either all meet at an NVSwitch (`intra_node =
"nvswitch"`), are joined pair by pair by their own Infinity Fabric links (`"xgmi"`,
AMD Instinct platforms: a full mesh without a switch), hang off a PCIe tree
(`"pcie"`), or are CPU ranks sharing one host (`"host"`). A PCIe tree is described by three group sizes, in GPU index
order: GPUs behind one PCIe switch (nvidia-smi PIX between them), behind one
root port through cascaded switches (PXB), and on one NUMA node (NODE; SYS
across sockets). `nvlink_bridge_pairs` adds NVLink bridges between GPUs 2i and
2i+1. A detected node instead carries the label matrix it was measured with
(`gpu_links`), exactly as `nvidia-smi topo -m` printed it.

A "node" is an NVLink domain: the GPUs that reach each other over NVLink.
In a DGX/HGX box that is the box. In a rack-scale system (GB200/GB300 NVL72)
it is the rack: 72 GPUs on one NVLink switch fabric, in compute trays of
`gpus_per_tray` (4) GPUs, each tray with its own NICs. Such a domain can be
used in part: a job of n GPUs that is not a multiple of 72 takes, per rack,
the largest whole number of trays that divides n (128 GPUs: two racks of 64,
16 trays each, how 72-GPU racks run power-of-two layouts), so TP, EP and CP
groups of up to a domain stay on NVLink.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from topologies.errors import TopologyError
from topologies.hardware import GPUSpec, get_gpu

INTRA_NODE_KINDS = ("nvswitch", "xgmi", "pcie", "host")
# Sizes beyond any machine built (the largest 2025 clusters hold ~2^17 GPUs; the
# largest NVLink domain, NVL576, 576): a larger number is a typo, and bounding it
# keeps every per-rank table the planner and `topo bench` build small.
MAX_WORLD_SIZE = 2**20
MAX_GPUS_PER_NODE = 1024


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPUSpec
    gpus_per_node: int
    n_nodes: int = 1
    intra_node: str = "nvswitch"  # nvswitch: all-to-all NVLink; xgmi: AMD's full mesh; pcie: PCIe switches; host: CPU ranks
    nics_per_node: int = 8  # inter-node NICs per node (rail-aligned when == gpus_per_node)
    nic_gbit_per_s: float = 400.0  # line rate of one NIC, per direction
    inter_node_oversubscription: float = 1.0  # fat-tree oversubscription above a leaf (1 = non-blocking)
    description: str = ""
    nodes_per_leaf: int = 32  # nodes under one leaf switch (a DGX SuperPOD scalable unit has 32)
    gpus_per_pcie_switch: int = 1  # GPUs sharing one PCIe switch (PIX between them)
    gpus_per_pcie_root: int = 0  # GPUs under one root port via cascaded switches (PXB); 0: = switch
    gpus_per_numa_node: int = 0  # GPUs on one CPU socket / NUMA node (SYS across); 0: all of them
    nvlink_bridge_pairs: bool = False  # NVLink bridges join GPUs 2i and 2i+1 (PCIe boxes)
    gpu_links: tuple[tuple[str, ...], ...] = ()  # detected `nvidia-smi topo -m` labels; () = derive
    gpu_nic_links: tuple[tuple[str, ...], ...] = ()  # detected GPU x NIC labels; () = derive
    gpus_per_tray: int = 0  # rack-scale NVLink domains: GPUs per compute tray (0: the node is one box)
    # The node's host: what CPU offload prices (planner.simulate.offload). 0: not stated, and then a plan
    # that offloads is refused with the --set keys to state them. Per node (a rack-scale domain: all its trays).
    host_memory_bytes: int = 0  # DRAM (LPDDR5X on Grace) of the node, bytes
    host_memory_gbytes_per_s: float = 0.0  # its theoretical peak bandwidth (channels x rate x 8 B), 1e9 B/s
    host_cores: int = 0  # CPU cores of the node, all sockets

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "n_nodes", "nodes_per_leaf", "gpus_per_pcie_switch"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise TopologyError(f"cluster {self.name!r}: {key} must be an integer >= 1, got {getattr(self, key)!r}")
        for key in ("gpus_per_pcie_root", "gpus_per_numa_node", "nics_per_node", "gpus_per_tray", "host_memory_bytes",
                    "host_cores"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise TopologyError(f"cluster {self.name!r}: {key} must be an integer >= 0, got {getattr(self, key)!r}")
        if self.gpus_per_node > MAX_GPUS_PER_NODE or self.nics_per_node > MAX_GPUS_PER_NODE:
            raise TopologyError(f"cluster {self.name!r}: gpus_per_node ({self.gpus_per_node}) and nics_per_node "
                                f"({self.nics_per_node}) must be at most {MAX_GPUS_PER_NODE}")
        if self.n_nodes * self.gpus_per_node > MAX_WORLD_SIZE:
            raise TopologyError(f"cluster {self.name!r}: {self.n_nodes} nodes x {self.gpus_per_node} GPUs = "
                                f"{self.n_nodes * self.gpus_per_node:,} GPUs exceeds the {MAX_WORLD_SIZE:,} meshplan "
                                "models; use fewer nodes")
        if self.intra_node not in INTRA_NODE_KINDS:
            raise TopologyError(
                f"cluster {self.name!r}: intra_node must be one of {INTRA_NODE_KINDS}, got {self.intra_node!r}"
            )
        if self.intra_node == "nvswitch" and self.gpu.nvlink_gbytes_per_s <= 0 and self.gpus_per_node > 1:
            raise TopologyError(
                f"cluster {self.name!r}: intra_node 'nvswitch' needs a GPU with NVLink, and {self.gpu.name} has "
                "none; use intra_node=pcie"
            )
        if self.intra_node == "xgmi" and self.gpu.xgmi_links < self.gpus_per_node - 1:
            raise TopologyError(
                f"cluster {self.name!r}: intra_node 'xgmi' joins every GPU pair of a node by its own Infinity "
                f"Fabric link, so {self.gpus_per_node} GPUs need {self.gpus_per_node - 1} xGMI links per GPU and "
                f"{self.gpu.name} has {self.gpu.xgmi_links}; use intra_node=pcie or fewer gpus_per_node"
            )
        if self.nvlink_bridge_pairs and self.gpu.nvlink_links == 0:
            raise TopologyError(f"cluster {self.name!r}: nvlink_bridge_pairs needs NVLink, {self.gpu.name} has none")
        for key in ("nic_gbit_per_s", "inter_node_oversubscription", "host_memory_gbytes_per_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
                raise TopologyError(f"cluster {self.name!r}: {key} must be a finite number, got {value!r}")
        if self.host_memory_gbytes_per_s < 0:
            raise TopologyError(f"cluster {self.name!r}: host_memory_gbytes_per_s must be >= 0, got "
                                f"{self.host_memory_gbytes_per_s}")
        if self.nic_gbit_per_s <= 0 or self.inter_node_oversubscription < 1:
            raise TopologyError(
                f"cluster {self.name!r}: nic_gbit_per_s must be > 0 (got {self.nic_gbit_per_s}) and "
                f"inter_node_oversubscription >= 1 (got {self.inter_node_oversubscription})"
            )
        if self.n_nodes > 1 and self.nics_per_node == 0:
            raise TopologyError(f"cluster {self.name!r}: {self.n_nodes} nodes need nics_per_node >= 1")
        self._check_links()

    def _check_links(self) -> None:
        from topologies.links import check_label

        n, nics = self.gpus_per_node, self.nics_per_node
        for key, cols in (("gpu_links", n), ("gpu_nic_links", nics)):
            matrix = getattr(self, key)
            if matrix and (len(matrix) != n or any(len(row) != cols for row in matrix)):
                raise TopologyError(
                    f"cluster {self.name!r}: {key} must be a {n} x {cols} matrix (gpus_per_node x "
                    f"{'gpus_per_node' if key == 'gpu_links' else 'nics_per_node'}), got {len(matrix)} rows"
                )
            for i, row in enumerate(matrix):
                for j, label in enumerate(row):
                    check_label(label, diagonal=key == "gpu_links" and i == j)

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @property
    def nic_gbytes_per_s(self) -> float:
        """One NIC's line rate per direction in 1e9 bytes/s (Gbit/s / 8)."""
        return self.nic_gbit_per_s / 8.0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["gpu"] = self.gpu.to_json()
        data["gpu_links"] = [list(row) for row in self.gpu_links]
        data["gpu_nic_links"] = [list(row) for row in self.gpu_nic_links]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cluster:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        gpu = kwargs.get("gpu")
        if isinstance(gpu, dict):
            kwargs["gpu"] = GPUSpec.from_json(gpu)
        elif isinstance(gpu, str):
            kwargs["gpu"] = get_gpu(gpu)
        else:
            raise TopologyError("cluster JSON needs a 'gpu' object or name")
        for key in ("gpu_links", "gpu_nic_links"):
            kwargs[key] = tuple(tuple(str(x) for x in row) for row in kwargs.get(key) or ())
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise TopologyError(f"malformed cluster JSON: {exc}") from None

    def with_gpus(self, n_gpus: int) -> Cluster:
        """This cluster sized for n_gpus: ceil(n / gpus_per_node) whole nodes, or one partial node.

        A count below one node's size gives one node with that many GPUs (the
        first ones: a detected link matrix is cut to its leading block). A
        larger count must fill whole nodes, since the rank grid assumes every
        node holds gpus_per_node ranks.
        """
        per = self.gpus_per_node
        if not isinstance(n_gpus, int) or n_gpus < 1:
            raise TopologyError(f"--gpus must be a positive integer, got {n_gpus!r}")
        if n_gpus > MAX_WORLD_SIZE:
            raise TopologyError(f"--gpus {n_gpus:,} exceeds the {MAX_WORLD_SIZE:,} GPUs meshplan models; "
                                "use a smaller count")
        if n_gpus <= per:
            links = tuple(row[:n_gpus] for row in self.gpu_links[:n_gpus])
            nics = self.nics_per_node * n_gpus // per if self.gpus_per_tray else self.nics_per_node
            return dataclasses.replace(self, gpus_per_node=n_gpus, n_nodes=1, gpu_links=links,
                                       gpu_nic_links=self.gpu_nic_links[:n_gpus], nics_per_node=nics,
                                       **self._host_share(n_gpus))
        if n_gpus % per and self.gpus_per_tray:
            domain = _partial_domain(n_gpus, per, self.gpus_per_tray)
            if domain:
                return dataclasses.replace(self, gpus_per_node=domain, n_nodes=n_gpus // domain,
                                           nics_per_node=self.nics_per_node * domain // per,
                                           **self._host_share(domain))
        if n_gpus % per:
            lower, upper = n_gpus // per * per, -(-n_gpus // per) * per
            raise TopologyError(
                f"cluster {self.name!r} has {per} GPUs per node, so --gpus {n_gpus} does not fill whole nodes; "
                f"use 1-{per} (one node) or a multiple of {per}: {lower} or {upper}"
            )
        return dataclasses.replace(self, n_nodes=n_gpus // per)

    def _host_share(self, n_gpus: int) -> dict[str, Any]:
        """The host of n_gpus of a node: all of it in one box (the GPUs left idle leave theirs to the others);
        on a rack-scale domain (gpus_per_tray) only the trays those GPUs sit in, each tray its own CPUs."""
        if not self.gpus_per_tray:
            return {}
        trays, total = -(-n_gpus // self.gpus_per_tray), self.gpus_per_node // self.gpus_per_tray or 1
        return {"host_memory_bytes": self.host_memory_bytes * trays // total,
                "host_memory_gbytes_per_s": self.host_memory_gbytes_per_s * trays / total,
                "host_cores": self.host_cores * trays // total}

    def with_nodes(self, n_nodes: int, gpus_per_node: int) -> Cluster:
        """This cluster as n_nodes nodes of gpus_per_node GPUs: what a job has after losing (or regaining)
        nodes or GPUs. Fewer GPUs per node than described take the first ones (with_gpus); more need a node
        description without a measured link matrix, which cannot be extended."""
        if not isinstance(n_nodes, int) or n_nodes < 1 or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise TopologyError(f"a cluster needs at least 1 node of 1 GPU, got {n_nodes!r} x {gpus_per_node!r}")
        if gpus_per_node <= self.gpus_per_node:
            node = self.with_gpus(gpus_per_node) if gpus_per_node < self.gpus_per_node else self
        elif self.gpu_links:
            raise TopologyError(f"cluster {self.name!r}: its link matrix is measured for {self.gpus_per_node} GPUs "
                                f"per node, so it cannot describe {gpus_per_node}; detect the node again "
                                "(`meshplan topo detect`) and plan for it")
        else:
            node = dataclasses.replace(self, gpus_per_node=gpus_per_node)
        return dataclasses.replace(node, n_nodes=n_nodes)



def _partial_domain(n_gpus: int, per_domain: int, per_tray: int) -> int:
    """GPUs used per NVLink domain for n_gpus: whole trays, at most per_domain, dividing n_gpus (0: none)."""
    for trays in range(per_domain // per_tray, 0, -1):
        if n_gpus % (trays * per_tray) == 0:
            return trays * per_tray
    return 0
