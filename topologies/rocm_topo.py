"""Reading `rocm-smi --showtopo`: an AMD node's link matrix, as `nvidia-smi topo -m` is read for NVIDIA.

rocm-smi prints sections under `==== Title ====` banners (the AMD SMI library's
samples use `**Title**` instead): three GPU x GPU matrices, "Weight between two
GPUs", "Hops between two GPUs" and "Link Type between two GPUs" (a header of
GPU0 ... GPUn, one row per GPU, `0` or `X` on the diagonal, XGMI or PCIE off it),
then per-GPU lines such as `GPU[3]  : (Topology) Numa Node: 0`. The same call
can print the product and memory lines (`rocm-smi --showtopo --showproductname
--showmeminfo vram`): `GPU[0] : Card Series: AMD Instinct MI300X` and `GPU[0] :
VRAM Total Memory (B): 206141652992`, which name the GPU and its real memory.

Labels: an XGMI pair keeps `XGMI` (one direct Infinity Fabric link); a PCIE pair
becomes `NODE` on one NUMA node and `SYS` across (rocm-smi does not say whether a
PCIe switch joins them, so the host-bridge level is assumed). The matrix lists no
NICs: a detected node gets one per GPU (AMD's platforms are rail-aligned) at the
line rate `DETECTED_NIC_GBIT_PER_S` assumed for nvidia-smi too, and says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from topologies.errors import TopologyError
from topologies.smi_topo import SmiTopology, run_gpu_tool

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_BANNER = re.compile(r"^\s*(?:=+|\*\*)\s*(.*?)\s*(?:=+|\*\*)\s*$")
_PER_GPU = re.compile(r"^\s*(?:GPU|HCU)\[(\d+)\]\s*:\s*([^:]+?)\s*:\s*(.*?)\s*$")
_MATRICES = {"weight between two gpus": "weight", "hops between two gpus": "hops",
             "link type between two gpus": "link"}
ROCM_LINK_TYPES = ("XGMI", "PCIE")


@dataclass(frozen=True)
class RocmCapture:
    """What one rocm-smi call printed: the topology, and per GPU its product name and memory (when shown)."""

    topo: SmiTopology
    card_series: tuple[str, ...]  # "AMD Instinct MI300X" per GPU; () when --showproductname was not given
    vram_bytes: tuple[int, ...]  # per GPU; () when --showmeminfo vram was not given
    hops: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[int, ...], ...]


def is_rocm_topo(text: str) -> bool:
    """True for rocm-smi's output (its banner or its link-type matrix), False for nvidia-smi's."""
    low = text.lower()
    return "rocm system management interface" in low or "link type between two gpus" in low


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """Banner title (lower case) -> the lines under it, up to the next banner."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in lines:
        m = _BANNER.match(line)
        if m:  # a titled banner opens a section; a bare rule of '=' only separates
            if m.group(1):
                current = m.group(1).lower()
                out.setdefault(current, [])
        elif current:
            out[current].append(line)
    return out


def _matrix(title: str, lines: list[str]) -> list[list[str]]:
    """The GPU x GPU cells of one matrix section, checked square and in order."""
    rows = [line.split() for line in lines if line.strip()]
    if not rows or not rows[0] or rows[0][0] != "GPU0":
        raise TopologyError(f"rocm-smi --showtopo: the '{title}' section has no GPU0 ... header line")
    header = rows[0]
    body = [r for r in rows[1:] if r[0].startswith("GPU")]
    n = len(header)
    if [r[0] for r in body] != header:
        raise TopologyError(f"rocm-smi --showtopo: the '{title}' rows {[r[0] for r in body]} do not match its "
                            f"columns {header}")
    short = [r[0] for r in body if len(r) != n + 1]
    if short:
        raise TopologyError(f"rocm-smi --showtopo: row {short[0]} of '{title}' does not have {n} cells")
    return [r[1:] for r in body]


def _label(cell: str, i: int, j: int, numa: tuple[str, ...]) -> str:
    if i == j:
        if cell not in ("0", "X"):
            raise TopologyError(f"rocm-smi --showtopo: GPU{i} with itself is {cell!r}; expected 0 or X")
        return "X"
    kind = cell.upper()
    if kind == "XGMI":
        return "XGMI"
    if kind == "PCIE":
        return "NODE" if numa[i] and numa[i] == numa[j] else "SYS"
    raise TopologyError(f"rocm-smi --showtopo: unknown link type {cell!r} between GPU{i} and GPU{j}; "
                        f"expected {' or '.join(ROCM_LINK_TYPES)}")


def _ints(title: str, cells: list[list[str]]) -> tuple[tuple[int, ...], ...]:
    try:
        return tuple(tuple(0 if c in ("X", "N/A") else int(c) for c in row) for row in cells)
    except ValueError:
        raise TopologyError(f"rocm-smi --showtopo: the '{title}' matrix holds a cell that is not a number") from None


def parse_rocm_topo(text: str) -> RocmCapture:
    """Parse what `rocm-smi --showtopo [--showproductname] [--showmeminfo vram]` prints."""
    lines = [_ANSI.sub("", raw).rstrip() for raw in text.splitlines()]
    sections = _sections(lines)
    found = {key: _matrix(title, sections[title]) for title, key in _MATRICES.items() if title in sections}
    if "link" not in found:
        raise TopologyError("no `rocm-smi --showtopo` link matrix found (a 'Link Type between two GPUs' section); "
                            "save the output of `rocm-smi --showtopo --showproductname` and pass it with --from-file")
    links = found["link"]
    n = len(links)
    per_gpu: dict[int, dict[str, str]] = {}
    for line in lines:
        m = _PER_GPU.match(line)
        if m:
            per_gpu.setdefault(int(m.group(1)), {})[m.group(2).lower()] = m.group(3)
    numa = tuple(per_gpu.get(i, {}).get("(topology) numa affinity", per_gpu.get(i, {}).get("(topology) numa node", ""))
                 for i in range(n))
    labels = tuple(tuple(_label(links[i][j], i, j, numa) for j in range(n)) for i in range(n))
    for i in range(n):
        for j in range(n):
            if labels[i][j] != labels[j][i]:
                raise TopologyError(f"rocm-smi --showtopo: GPU{i}-GPU{j} is {links[i][j]} but GPU{j}-GPU{i} is "
                                    f"{links[j][i]}; the matrix must be symmetric")
    for key, cells in found.items():
        if len(cells) != n:
            raise TopologyError(f"rocm-smi --showtopo: the {key} matrix has {len(cells)} GPUs, the link matrix {n}")
    series = tuple(per_gpu.get(i, {}).get("card series", "") for i in range(n))
    vram = tuple(per_gpu.get(i, {}).get("vram total memory (b)", "") for i in range(n))
    topo = SmiTopology(gpus=tuple(f"GPU{i}" for i in range(n)), nics=(), gpu_links=labels,
                       gpu_nic_links=tuple(() for _ in range(n)), cpu_affinity=("",) * n, numa_affinity=numa)
    return RocmCapture(topo, series if all(series) else (), tuple(int(v) for v in vram) if all(
        v.isdigit() for v in vram) else (), _ints("hops", found.get("hops", [])), _ints("weight", found.get("weight", [])))


def gpu_of_capture(capture: RocmCapture):
    """The catalog GPU the capture's Card Series names, with its reported memory; None when it names none."""
    from topologies.smi_topo import gpu_from_smi_name

    if not capture.card_series:
        return None
    names = set(capture.card_series)
    if len(names) > 1:
        raise TopologyError(f"rocm-smi lists different GPUs in one node ({', '.join(sorted(names))}); meshplan "
                            "models one GPU kind per node: pass --gpu NAME")
    memory = capture.vram_bytes[0] / (1 << 20) if capture.vram_bytes else None
    return gpu_from_smi_name(capture.card_series[0], memory)


ROCM_SMI_ARGS = ("--showtopo", "--showproductname", "--showmeminfo", "vram")


def query_live_rocm() -> str:
    """Run rocm-smi here: the topology, product names and memory in one call."""
    return run_gpu_tool("rocm-smi", ROCM_SMI_ARGS)


__all__ = ["ROCM_SMI_ARGS", "RocmCapture", "gpu_of_capture", "is_rocm_topo", "parse_rocm_topo", "query_live_rocm"]
