"""`meshplan topo list|show|detect|bench`: the clusters the planner knows and what their links cost."""

from __future__ import annotations

import re
from pathlib import Path

import click

from topologies.cluster import Cluster
from topologies.cluster_load import load_cluster, parse_overrides, preset_names
from topologies.errors import UsageError
from topologies.terminal import console, emit_json, log

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)
SET_HELP = "What-if: override a cluster field, e.g. --set nic_gbit_per_s=200 (repeatable)."


def parse_size(text: str) -> int:
    """'1GiB', '8M', '512KB', '4096' -> bytes. K/M/G alone and KiB/MiB/GiB are binary (as nccl-tests),
    KB/MB/GB decimal."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"--size {text!r} is not a size; use e.g. 1GiB, 8MiB, 512K or 4096 (bytes)")
    number, unit, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).upper()
    power = " KMGT".index(unit) if unit else 0
    base = 1000 if suffix == "B" and unit else 1024
    return int(number * base**power)


def parse_sizes(text: str) -> list[int]:
    """'8MiB:8GiB' -> 8MiB, 16MiB, ... 8GiB (factor 2, as nccl-tests -f 2); a single size -> [size]."""
    if ":" not in text:
        return [parse_size(text)]
    lo_text, _, hi_text = text.partition(":")
    lo, hi = parse_size(lo_text), parse_size(hi_text)
    if lo < 1 or hi < lo:
        raise UsageError(f"--size {text!r}: the sweep needs 1 <= MIN <= MAX, got {lo} and {hi} bytes")
    sizes = [lo]
    while sizes[-1] * 2 <= hi:
        sizes.append(sizes[-1] * 2)
    return sizes


def cluster_summary(c: Cluster) -> dict:
    """`topo show --json`: the resolved cluster plus the node's link matrices."""
    from topologies.graph import gpu_nic_paths, node_link_table
    from topologies.links import derive_labels

    table = node_link_table(c)
    return {
        **c.to_json(),
        "world_size": c.world_size,
        "gpu_links": [list(row) for row in derive_labels(c)],
        "gpu_pair_gbytes_per_s": [list(row) for row in table.gbytes_per_s],
        "gpu_nic_gbytes_per_s": [bw for bw, _ in gpu_nic_paths(c)],
    }


@click.group(epilog="\b\nExamples:\n  meshplan topo list\n  meshplan topo show dgx-h100 --gpus 16\n  meshplan topo bench --op all_reduce --size 1KiB:1GiB --gpus 16\n  meshplan topo detect --save mynode.toml\n")
def topo() -> None:
    """Clusters: presets, custom TOML files, nvidia-smi / rocm-smi detection and collective costs."""


@topo.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def list_clusters(as_json: bool) -> None:
    """List the cluster presets."""
    clusters = [load_cluster(name) for name in preset_names()]
    rows = [{"name": c.name, "gpu": c.gpu.name, "gpus_per_node": c.gpus_per_node, "intra_node": c.intra_node,
             "nics_per_node": c.nics_per_node, "nic_gbit_per_s": c.nic_gbit_per_s, "description": c.description}
            for c in clusters]
    if as_json:
        emit_json(rows)
        return
    from rich.table import Table

    table = Table(title="meshplan clusters (presets; any .toml path works too)")
    for col in ("name", "gpu", "GPUs", "NICs", "description"):
        table.add_column(col, justify="right" if col in ("GPUs", "NICs") else "left", no_wrap=col != "description")
    for r in rows:
        table.add_row(r["name"], r["gpu"], str(r["gpus_per_node"]), f"{r['nics_per_node']}x{r['nic_gbit_per_s']:g}G",
                      r["description"])
    console().print(table)


@topo.command("show")
@click.argument("name")
@click.option("--gpus", type=int, default=None, help="Size the cluster for N GPUs (whole nodes).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def show_cluster(name: str, gpus: int | None, sets: tuple[str, ...], as_json: bool) -> None:
    """Show a resolved cluster (NAME: preset or TOML path): fields, GPU link matrix, fabric."""
    c = load_cluster(name, gpus, parse_overrides(sets))
    if as_json:
        emit_json(cluster_summary(c))
        return
    from topologies.cli.view import print_cluster

    print_cluster(c)


@topo.command("detect")
@click.option("--from-file", "from_file", type=click.Path(dir_okay=False), default=None,
              help="Saved output of `nvidia-smi topo -m` or `rocm-smi --showtopo [--showproductname]` (default: run "
                   "nvidia-smi, or rocm-smi, here).")
@click.option("--gpu", "gpu_name", default=None,
              help="GPU model (default: what the driver names, or a guess from NVLink counts).")
@click.option("--save", type=click.Path(dir_okay=False), default=None,
              help="Write the detected node as a cluster TOML file for --cluster PATH.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def detect(from_file: str | None, gpu_name: str | None, save: str | None, as_json: bool) -> None:
    """Read this node's topology from nvidia-smi or rocm-smi (or a saved copy of either's output)."""
    import shutil

    from topologies.files import check_output
    from topologies.hardware import get_gpu
    from topologies.rocm_topo import gpu_of_capture, is_rocm_topo, parse_rocm_topo, query_live_rocm
    from topologies.smi_topo import detect_cluster, guess_gpu, parse_topo, query_live

    check_output(save, "--save")
    live_gpu = None
    if from_file:
        try:
            text = Path(from_file).read_text(errors="replace")
        except OSError as exc:
            raise UsageError(f"cannot read --from-file {from_file}: {exc.strerror}") from None
    elif shutil.which("nvidia-smi") is None and shutil.which("rocm-smi") is not None:
        text = query_live_rocm()
    else:
        text, live_gpu = query_live()
    rocm = is_rocm_topo(text)
    if rocm:
        capture = parse_rocm_topo(text)
        parsed, source = capture.topo, "rocm-smi --showtopo"
        live_gpu = None if gpu_name else gpu_of_capture(capture)
    else:
        parsed, source = parse_topo(text), "nvidia-smi topo -m"
    if gpu_name:
        gpu = get_gpu(gpu_name)
    elif live_gpu is not None:
        gpu = live_gpu
    elif rocm:
        raise UsageError("the rocm-smi output names no GPU (no 'Card Series' lines): pass --gpu NAME (mi300x, "
                         "mi325x, mi350x, mi355x), or save `rocm-smi --showtopo --showproductname --showmeminfo vram`")
    else:
        gpu = guess_gpu(parsed)
        log(f"assuming GPU {gpu.name} from the NVLink counts; pass --gpu NAME to choose")
    c = detect_cluster(parsed, gpu, source=source, lists_nics=not rocm)
    if save:
        from topologies.cluster_load import write_cluster_toml

        write_cluster_toml(c, save)
        log(f"wrote {save}; use it with --cluster {save}")
    summary = cluster_summary(c)
    if as_json:
        emit_json({"gpus_per_node": c.gpus_per_node, "gpu_links": summary["gpu_links"],
                   "gpu_pair_gbytes_per_s": summary["gpu_pair_gbytes_per_s"], "gpu": gpu.name,
                   "intra_node": c.intra_node, "nics": list(parsed.nics), "source": source,
                   "numa_affinity": list(parsed.numa_affinity), "cluster": c.to_json()})
        return
    from topologies.cli.view import print_cluster

    print_cluster(c)


@topo.command("bench")
@click.option("--cluster", "cluster_name", default="dgx-h100", show_default=True, help="Preset name or TOML path.")
@click.option("--op", default="all_reduce", show_default=True,
              help="all_reduce, all_gather, reduce_scatter, all_to_all, broadcast or sendrecv.")
@click.option("--size", default="1GiB", show_default=True, help="Bytes (nccl-tests sizes), or MIN:MAX to sweep x2.")
@click.option("--gpus", type=int, default=None, help="Ranks (default: one node).")
@click.option("--algo", default=None, help="Force one algorithm (ring, tree, nvls, nvls_tree, hierarchical).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def bench(cluster_name: str, op: str, size: str, gpus: int | None, algo: str | None, sets: tuple[str, ...],
          as_json: bool) -> None:
    """Predict a collective like nccl-tests would measure it: time, algbw, busbw."""
    from topologies.cli.view import bench_rows, print_bench

    c = load_cluster(cluster_name, gpus, parse_overrides(sets))
    rows = bench_rows(c, op, parse_sizes(size), algo)
    if as_json:
        emit_json(rows[0] if ":" not in size else rows)
        return
    print_bench(c, rows)
