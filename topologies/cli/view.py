"""What `meshplan topo show|detect|bench` print for people (the JSON views live in topologies.cli.topo)."""

from __future__ import annotations

import click

from topologies.cluster import Cluster
from topologies.collectives import CollectiveModel, bus_bandwidth_gbytes_per_s, busbw_factor, normalize_op
from topologies.errors import UsageError
from topologies.graph import nic_share_gbytes_per_s
from topologies.hardware import GIB
from topologies.links import (
    EFFICIENCY,
    derive_labels,
    label_gbytes_per_s,
    label_latency_s,
    link_class,
    nic_label,
    nic_of_gpu,
)
from topologies.terminal import console

_STYLE = {"XGMI": "green", "PIX": "yellow", "PXB": "yellow", "PHB": "dark_orange", "NODE": "red", "SYS": "red", "SHM": "cyan"}
ELEMENT_BYTES = 4  # nccl-tests' default type is float


def _styled(label: str) -> str:
    style = "green" if label.startswith("NV") else _STYLE.get(label, "bold")
    return f"[{style}]{label}[/]"


def _gpu_line(c: Cluster) -> str:
    g = c.gpu
    nvlink = f", NVLink{g.nvlink_gen} {g.nvlink_gbytes_per_s:g} GB/s/dir" if g.nvlink_gbytes_per_s else ""
    if g.xgmi_links:
        nvlink += f", Infinity Fabric {g.xgmi_links} x {g.xgmi_link_gbytes_per_s:g} GB/s/dir"
    if not g.pcie_p2p:
        nvlink += " (no PCIe peer-to-peer: GPU traffic through host memory)"
    bf16 = f"{g.bf16_flops / 1e12:g} BF16" if g.bf16_flops else f"{g.fp16_flops / 1e12:g} FP16"
    return (f"{g.name}: {g.memory_bytes / GIB:.1f} GiB at {g.memory_gbytes_per_s:g} GB/s, {bf16} TFLOP/s dense, "
            f"PCIe Gen{g.pcie_gen}{nvlink}")


def _fabric_line(c: Cluster) -> str:
    if c.nics_per_node == 0:
        return "no NICs: a single node"
    rails = "rail-aligned (GPU i -> NIC i)" if c.nics_per_node == c.gpus_per_node else \
        f"GPU i -> NIC i*{c.nics_per_node}//{c.gpus_per_node}"
    leaves = -(-c.n_nodes // c.nodes_per_leaf)
    tree = "one leaf switch" if leaves == 1 else f"{leaves} leaf switches under a spine"
    over = "non-blocking" if c.inter_node_oversubscription == 1 else f"{c.inter_node_oversubscription:g}:1 oversubscribed"
    return (f"{c.n_nodes} node(s) x {c.nics_per_node} NIC(s) at {c.nic_gbit_per_s:g} Gbit/s, {rails}; fat tree, "
            f"{tree} ({c.nodes_per_leaf} nodes per leaf), {over}; fabric share per GPU "
            f"{nic_share_gbytes_per_s(c):.1f} GB/s/dir")


def print_cluster(c: Cluster) -> None:
    """Fields, the node's GPU-to-GPU link matrix (one node: all nodes are alike), the labels' costs, the fabric."""
    from rich.table import Table

    out = console()
    out.print(f"[bold]{c.name}[/]: {c.description}")
    out.print(f"  {c.n_nodes} x {c.gpus_per_node} = {c.world_size} GPUs, in node: {c.intra_node}")
    out.print(f"  GPU  {_gpu_line(c)}")
    out.print(f"  net  {_fabric_line(c)}")
    labels = derive_labels(c)
    n = c.gpus_per_node
    matrix = Table(title="GPU-to-GPU links in one node (nvidia-smi topo -m / rocm-smi --showtopo labels)",
                   show_lines=False)
    matrix.add_column("")
    for j in range(n):
        matrix.add_column(f"GPU{j}", justify="center")
    if c.nics_per_node:
        matrix.add_column("NIC", justify="left")
    for i in range(n):
        nic = [f"NIC{nic_of_gpu(c, i)} {nic_label(c, i, nic_of_gpu(c, i))}"] if c.nics_per_node else []
        matrix.add_row(f"GPU{i}", *("X" if i == j else _styled(labels[i][j]) for j in range(n)), *nic)
    out.print(matrix)
    legend = Table(title="what each label costs (per direction)")
    for col in ("label", "raw GB/s", "NCCL GB/s", "latency us"):
        legend.add_column(col, justify="left" if col == "label" else "right")
    seen = sorted({lab for row in labels for lab in row if lab != "X"})
    for lab in seen:
        raw = label_gbytes_per_s(lab, c.gpu)
        legend.add_row(_styled(lab), f"{raw:.1f}", f"{raw * EFFICIENCY[link_class(lab)]:.1f}",
                       f"{label_latency_s(lab) * 1e6:.1f}")
    if c.nics_per_node:
        legend.add_row("NIC", f"{c.nic_gbytes_per_s:.1f}", f"{c.nic_gbytes_per_s * EFFICIENCY['net']:.1f}", "")
    out.print(legend)
    if c.n_nodes > 1:
        out.print(_fabric_tree(c))


def _fabric_tree(c: Cluster):
    """The fat tree: spine (when there are several leaves), leaves, the nodes under each."""
    from rich.tree import Tree

    leaves = -(-c.n_nodes // c.nodes_per_leaf)
    over = "" if c.inter_node_oversubscription == 1 else f", uplinks {c.inter_node_oversubscription:g}:1"
    root = Tree(f"[bold]spine[/]{over}" if leaves > 1 else "[bold]fabric[/]: one leaf switch")
    for leaf in range(min(leaves, 4)):
        first, last = leaf * c.nodes_per_leaf, min((leaf + 1) * c.nodes_per_leaf, c.n_nodes) - 1
        root.add(f"leaf{leaf}: nodes {first}-{last}, {c.nics_per_node} x {c.nic_gbit_per_s:g} Gbit/s each")
    if leaves > 4:
        root.add(f"... {leaves - 4} more leaves")
    return root


def bench_rows(c: Cluster, op: str, sizes: list[int], algo: str | None) -> list[dict]:
    """Predicted nccl-tests rows: the whole cluster as one group (sendrecv: every rank to the next)."""
    op = normalize_op(op)
    n = c.world_size
    if n < 2:
        raise UsageError(f"a collective needs at least 2 ranks; cluster {c.name!r} has {n}: pass --gpus N")
    model = CollectiveModel(c)
    groups = [(i, (i + 1) % n) for i in range(n)] if op == "send_recv" else [tuple(range(n))]
    group_n = 2 if op == "send_recv" else n
    rows = []
    for size in sizes:
        worst = (-1.0, "")
        for group in groups:
            algs = model.algorithms(op, size, group)
            if algo is not None and algo not in algs:
                raise UsageError(f"--algo {algo} does not apply to {op} over {group_n} ranks on {c.name}; "
                                 f"available: {', '.join(sorted(algs))}")
            name = algo or min(algs, key=algs.get)
            worst = max(worst, (algs[name], name))
        t, name = worst
        rows.append({"cluster": c.name, "op": op, "size_bytes": size, "n_ranks": n, "n_nodes": c.n_nodes,
                     "algorithm": name, "time_s": t, "algbw_gbytes_per_s": size / t / 1e9,
                     "busbw_gbytes_per_s": bus_bandwidth_gbytes_per_s(op, group_n, size, t)})
    return rows


def print_bench(c: Cluster, rows: list[dict]) -> None:
    """A table shaped like nccl-tests' output, with the algorithm the model picked."""
    op = rows[0]["op"]
    echo = click.echo
    echo(f"# meshplan topo bench (predicted): {op} on {c.name}, {c.world_size} ranks "
         f"({c.n_nodes} node(s) x {c.gpus_per_node}), busbw factor {busbw_factor(op, c.world_size):.4g}")
    echo("#")
    echo(f"# {'size':>12} {'count':>12} {'type':>6} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8}  algorithm")
    echo(f"# {'(B)':>12} {'(elements)':>12} {'':>6} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
    for r in rows:
        redop = "sum" if op in ("all_reduce", "reduce_scatter") else "none"
        echo(f"  {r['size_bytes']:>12} {r['size_bytes'] // ELEMENT_BYTES:>12} {'float':>6} {redop:>6} "
             f"{r['time_s'] * 1e6:>10.1f} {r['algbw_gbytes_per_s']:>8.2f} {r['busbw_gbytes_per_s']:>8.2f}  "
             f"{r['algorithm']}")
    avg = sum(r["busbw_gbytes_per_s"] for r in rows) / len(rows)
    echo(f"# Avg bus bandwidth    : {avg:.3f}")
