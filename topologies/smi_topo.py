"""Reading `nvidia-smi topo -m`: the node's link matrix, as the driver reports it.

The matrix has one row and one column per GPU and per NIC (named NIC<j> with
a "NIC Legend" on recent drivers, by device name such as mlx5_0 on older ones),
then CPU Affinity, NUMA Affinity and GPU NUMA ID columns (the last two absent
on older drivers). Cells are X, NV<k>, PIX, PXB, PHB, NODE, SYS (SOC on very
old drivers, the same thing). Columns are tab separated, but copies pasted
from a terminal have runs of spaces instead; the header is often wrapped in
ANSI underline codes. Below the matrix come the Legend and NIC Legend blocks.

`parse_topo` turns the text into an SmiTopology; `detect_cluster` makes a
one-node Cluster of it, keeping the measured labels. NICs that no GPU reaches
through PCIe switches alone (PIX/PXB: storage or management ports) are left
out when GPU-near NICs exist, and the rest are ordered by the GPU they serve,
so NIC rails line up with GPUs as the cost model assumes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from topologies.cluster import Cluster
from topologies.errors import HardwareError, TopologyError
from topologies.hardware import GPUS, GPUSpec, get_gpu
from topologies.links import check_label

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_AFFINITY = {"CPU Affinity": "CPU_Affinity", "NUMA Affinity": "NUMA_Affinity", "GPU NUMA ID": "GPU_NUMA_ID"}
_GPU = re.compile(r"^GPU\d+$")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_OLD_ALIASES = {"SOC": "SYS"}  # drivers before ~2017 printed SOC for a socket-level link
DETECTED_NIC_GBIT_PER_S = 100.0  # the matrix says nothing of line rates: assume 100 Gbit/s


@dataclass(frozen=True)
class SmiTopology:
    gpus: tuple[str, ...]  # GPU0, GPU1, ...
    nics: tuple[str, ...]  # device names (mlx5_0 ...) where a NIC Legend or old header gives them
    gpu_links: tuple[tuple[str, ...], ...]  # GPU x GPU labels as printed, X on the diagonal
    gpu_nic_links: tuple[tuple[str, ...], ...]  # GPU x NIC labels
    cpu_affinity: tuple[str, ...]  # per GPU, "" when absent
    numa_affinity: tuple[str, ...]  # per GPU, "" when the driver prints no NUMA column


def _header_cells(line: str) -> list[str]:
    for words, joined in _AFFINITY.items():
        line = line.replace(words, joined)
    return line.split()


def _find_header(lines: list[str]) -> int:
    for i, line in enumerate(lines):
        cells = _header_cells(line)
        if cells and cells[0] == "GPU0":
            return i
    raise TopologyError(
        "no `nvidia-smi topo -m` matrix found: expected a header line starting with GPU0; "
        "save the output of `nvidia-smi topo -m` to a file and pass it with --from-file"
    )


def _label(cell: str, where: str) -> str:
    label = _OLD_ALIASES.get(cell, cell)
    try:
        check_label(label, diagonal=label == "X")
    except TopologyError:
        raise TopologyError(f"nvidia-smi topo: unknown link label {cell!r} at {where}; "
                            "expected X, NV<k>, PIX, PXB, PHB, NODE or SYS") from None
    return label


def parse_topo(text: str) -> SmiTopology:
    """Parse the text `nvidia-smi topo -m` prints (ANSI codes, tabs or spaces, any driver age)."""
    lines = [_ANSI.sub("", raw).rstrip() for raw in text.splitlines()]
    start = _find_header(lines)
    header = _header_cells(lines[start])
    devices = [c for c in header if c not in _AFFINITY.values()]
    extra = [c for c in header if c in _AFFINITY.values()]
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if not cells:
            if rows:
                break
            continue
        if cells[0].rstrip(":") in ("Legend", "NIC"):
            break
        if cells[0] not in devices:
            raise TopologyError(f"nvidia-smi topo: row {cells[0]!r} is not a column of the header {devices}")
        rows[cells[0]] = cells[1:]
    gpus = [d for d in devices if _GPU.match(d)]
    missing = [g for g in gpus if g not in rows]
    if missing:
        raise TopologyError(f"nvidia-smi topo: no row for {', '.join(missing)}")
    index = {d: k for k, d in enumerate(devices)}
    labels = {g: [_label(c, f"row {g}, column {devices[k]}") for k, c in enumerate(rows[g][:len(devices)])]
              for g in gpus}
    short = [g for g in gpus if len(labels[g]) < len(devices)]
    if short:
        raise TopologyError(f"nvidia-smi topo: row {short[0]} has fewer cells than the {len(devices)} device columns")
    nics = [d for d in devices if not _GPU.match(d)]
    gpu_links = tuple(tuple(labels[g][index[h]] for h in gpus) for g in gpus)
    for i, row in enumerate(gpu_links):
        for j, lab in enumerate(row):
            if lab != gpu_links[j][i] or (lab == "X") != (i == j):
                raise TopologyError(f"nvidia-smi topo: {gpus[i]}-{gpus[j]} is {lab} but "
                                    f"{gpus[j]}-{gpus[i]} is {gpu_links[j][i]}; the matrix must be symmetric")
    affinity = {g: dict(zip(extra, rows[g][len(devices):], strict=False)) for g in gpus}
    legend = dict(m.groups() for line in lines if (m := _NIC_LEGEND.match(line)))
    return SmiTopology(
        gpus=tuple(gpus),
        nics=tuple(legend.get(n, n) for n in nics),
        gpu_links=gpu_links,
        gpu_nic_links=tuple(tuple(labels[g][index[n]] for n in nics) for g in gpus),
        cpu_affinity=tuple(affinity[g].get("CPU_Affinity", "") for g in gpus),
        numa_affinity=tuple(affinity[g].get("NUMA_Affinity", "") for g in gpus),
    )


def _near_nics(topo: SmiTopology) -> list[int]:
    """Indices of NICs to keep, ordered by the GPU they sit nearest (rail order)."""
    near = [j for j in range(len(topo.nics)) if any(row[j] in ("PIX", "PXB") for row in topo.gpu_nic_links)]
    keep = near or list(range(len(topo.nics)))
    rank = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}

    def first_gpu(j: int) -> tuple[int, int]:
        best = min(rank.get(row[j], 5) for row in topo.gpu_nic_links)
        return next(i for i, row in enumerate(topo.gpu_nic_links) if rank.get(row[j], 5) == best), j

    return sorted(keep, key=first_gpu)


def guess_gpu(topo: SmiTopology) -> GPUSpec:
    """The catalog GPU whose NVLink count matches the matrix (NV18: H100 SXM, NV12: A100 SXM...)."""
    counts = {int(lab[2:]) for row in topo.gpu_links for lab in row if lab.startswith("NV")}
    by_links = {18: "h100-sxm", 12: "a100-80g-sxm", 6: "v100", 4: "rtx3090"}
    if len(counts) == 1 and max(counts) in by_links:
        return get_gpu(by_links[max(counts)])
    if counts and max(counts) <= 2:  # DGX-1 style hybrid cube mesh of NV1/NV2 bonds
        return get_gpu("v100")
    raise TopologyError(
        "the matrix does not say which GPU this is; pass --gpu NAME "
        f"(one of {', '.join(n for n, g in GPUS.items() if g.kind == 'gpu')})"
    )


def detect_cluster(topo: SmiTopology, gpu: GPUSpec, name: str = "detected", source: str = "nvidia-smi topo -m",
                   lists_nics: bool = True) -> Cluster:
    """A one-node Cluster with the measured labels: NVSwitch when every GPU pair is NVLink, an xGMI mesh when
    every pair has its own Infinity Fabric link, else PCIe. A source that lists no NICs (`lists_nics`
    False: rocm-smi) gets one per GPU, rail-aligned, and the description says it was assumed."""
    off_diag = [lab for i, row in enumerate(topo.gpu_links) for j, lab in enumerate(row) if i != j]
    nvlinked = [lab for lab in off_diag if lab.startswith("NV")]
    if nvlinked and gpu.nvlink_gbytes_per_s <= 0:
        raise TopologyError(
            f"the matrix shows NVLink ({nvlinked[0]}) but {gpu.name} has none; pass the right --gpu"
        )
    xgmi = [lab for lab in off_diag if lab == "XGMI"]
    if xgmi and not gpu.xgmi_links:
        raise TopologyError(f"the matrix shows Infinity Fabric (XGMI) links but {gpu.name} has none; pass the "
                            "right --gpu (mi300x, mi325x, mi350x, mi355x)")
    all_nv = bool(off_diag) and len(nvlinked) == len(off_diag)
    all_xgmi = bool(off_diag) and len(xgmi) == len(off_diag) and gpu.xgmi_links >= len(topo.gpus) - 1
    n = len(topo.gpus)
    if lists_nics:
        keep = _near_nics(topo)
        nics = f"{len(keep)} NIC(s) ({', '.join(topo.nics[j] for j in keep) or 'none'})"
        nic_links = tuple(tuple(row[j] for j in keep) for row in topo.gpu_nic_links)
        n_nics = len(keep)
    else:
        nics, nic_links, n_nics = f"NICs not listed: {n} assumed, one per GPU (set nics_per_node)", (), n
    return Cluster(
        name=name,
        gpu=gpu,
        gpus_per_node=n,
        intra_node="nvswitch" if all_nv else "xgmi" if all_xgmi else "pcie",
        nics_per_node=n_nics,
        nic_gbit_per_s=DETECTED_NIC_GBIT_PER_S,
        description=f"detected by {source}: {n}x {gpu.name}, {nics}, "
                    f"line rate assumed {DETECTED_NIC_GBIT_PER_S:g} Gbit/s",
        gpu_links=topo.gpu_links,
        gpu_nic_links=nic_links,
    )


# `nvidia-smi --query-gpu=name`, `rocm-smi --showproductname`'s "Card Series" and torch's
# get_device_name -> catalog, first match wins (specific before general: H200 before H20, A100
# before A10, L40S before L4). Names are matched upper-case with spaces removed.
_SMI_NAMES = (
    (r"GB300", "gb300"), (r"GB200", "gb200"), (r"B300", "b300"), (r"B200", "b200"), (r"H200", "h200"),
    (r"H800.*PCIE", "h100-pcie"), (r"H800", "h800"), (r"H20(?!\d)", "h20"), (r"H100.*NVL", "h100-nvl"),
    (r"H100.*PCIE", "h100-pcie"), (r"H100", "h100-sxm"), (r"A(100|800).*PCIE", "a100-80g-pcie"),
    (r"A(100|800).*40GB", "a100-40g-sxm"), (r"A100|A800", "a100-80g-sxm"), (r"A10G", "a10g"), (r"A10(?!\d)", "a10"),
    (r"RTXA6000", "a6000"), (r"RTX6000ADA", "rtx6000-ada"), (r"L40S", "l40s"), (r"L4(?!\d)", "l4"),
    (r"5090", "rtx5090"), (r"4090", "rtx4090"), (r"3090", "rtx3090"), (r"(?<!R)T4(?!\d)", "t4"), (r"V100", "v100"),
    (r"MI300X", "mi300x"), (r"MI325X", "mi325x"), (r"MI350X", "mi350x"), (r"MI355X", "mi355x"),
)


# CUDA compute capability of each catalog GPU, as torch.cuda.get_device_capability reports it (NVIDIA's
# "CUDA GPUs" table; Blackwell Ultra B300/GB300 is sm_103, CUDA 12.9 release notes). Parts of one die share
# it (H100, H800 and H200 are 9.0), so it confirms a name read from the driver rather than replacing it.
COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "a100-40g-sxm": (8, 0), "a100-80g-sxm": (8, 0), "a100-80g-pcie": (8, 0),
    "h100-sxm": (9, 0), "h100-pcie": (9, 0), "h200": (9, 0), "h800": (9, 0),
    "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3), "gb300": (10, 3),
    "h20": (9, 0), "h100-nvl": (9, 0), "l40s": (8, 9), "l4": (8, 9), "rtx6000-ada": (8, 9), "rtx4090": (8, 9),
    "rtx5090": (12, 0), "rtx3090": (8, 6), "a6000": (8, 6), "a10": (8, 6), "a10g": (8, 6), "t4": (7, 5),
    "v100": (7, 0),
    # ROCm builds of torch report the gfx target's major.minor: MI300X and MI325X are gfx942, MI350X and
    # MI355X gfx950 (AMD's ROCm GPU support table).
    "mi300x": (9, 4), "mi325x": (9, 4), "mi350x": (9, 5), "mi355x": (9, 5),
}


def catalog_name(device_name: str) -> str | None:
    """The catalog GPU a driver-reported name (nvidia-smi, torch.cuda.get_device_name) stands for; None if unknown."""
    try:
        return gpu_from_smi_name(device_name).name
    except TopologyError:
        return None


def gpu_from_smi_name(name: str, memory_mib: float | None = None) -> GPUSpec:
    """Map a driver's GPU name ('NVIDIA A100-SXM4-80GB', 'AMD Instinct MI300X') to the catalog, with its memory."""
    from topologies.gpu_names import unknown_gpu_hint

    up = name.upper().replace(" ", "")
    key = next((key for pattern, key in _SMI_NAMES if re.search(pattern, up)), None)
    if key is None:
        raise TopologyError(f"GPU {name!r} is not in the catalog; pass --gpu NAME (one of {', '.join(GPUS)})"
                            f"{unknown_gpu_hint()}")
    spec = get_gpu(key)
    if memory_mib:
        import dataclasses

        spec = dataclasses.replace(spec, memory_bytes=int(memory_mib * (1 << 20)))
    return spec


def run_gpu_tool(tool: str, args: list[str] | tuple[str, ...]) -> str:
    """stdout of `tool ARGS` (nvidia-smi or rocm-smi); a HardwareError that says what to do when it is
    missing or fails."""
    if shutil.which(tool) is None:
        raise HardwareError("no GPU tools here: neither nvidia-smi nor rocm-smi is on PATH; run this on the GPU "
                            "node, or pass --from-file with saved `nvidia-smi topo -m` or `rocm-smi --showtopo` output")
    proc = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise HardwareError(f"{tool} {' '.join(args)} failed (exit {proc.returncode}): "
                            f"{(proc.stderr or proc.stdout).strip()[:200]}")
    return proc.stdout


def _run(args: list[str]) -> str:
    return run_gpu_tool("nvidia-smi", args)


def query_live() -> tuple[str, GPUSpec]:
    """Run nvidia-smi: (the topo -m text, the GPU model of device 0 with its real memory)."""
    csv = _run(["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]).strip().splitlines()
    if not csv:
        raise HardwareError("nvidia-smi lists no GPU on this machine")
    gpu_name, _, mem = csv[0].rpartition(",")
    try:
        memory_mib = float(mem)
    except ValueError:
        memory_mib = None
    return _run(["topo", "-m"]), gpu_from_smi_name(gpu_name.strip(), memory_mib)


__all__ = ["COMPUTE_CAPABILITY", "DETECTED_NIC_GBIT_PER_S", "SmiTopology", "catalog_name", "detect_cluster",
           "gpu_from_smi_name", "guess_gpu", "parse_topo", "query_live"]
