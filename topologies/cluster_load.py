"""Resolving a cluster: preset name or TOML path, `--set KEY=VALUE` what-ifs, `--gpus N`.

A preset is a TOML file under `topologies/presets/`; a custom cluster is a
TOML file with the same keys, given by path. Keys are the Cluster fields plus
the GPU what-ifs below (a custom file may say `gpu = "h100-sxm"` and
`gpu_memory_gib = 94`). The same keys are accepted by `--set`, so every
what-if a user can type is one a file can hold, and the other way round.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from topologies.cluster import Cluster
from topologies.errors import TopologyError, nearest
from topologies.gpu_names import nearest_by_family
from topologies.hardware import GIB, TFLOPS, GPUSpec, get_gpu

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


PRESET_DIR = Path(__file__).resolve().parent / "presets"


def _as_bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _as_float(text: Any) -> float:
    """A finite, non-negative number: NaN would act as infinite bandwidth and inf cannot be saved in JSON."""
    if isinstance(text, bool):
        raise ValueError("expected a number, not true/false")
    try:
        value = float(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("expected a number") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number (NaN and infinity are refused)")
    if value < 0:
        raise ValueError("expected a number >= 0")
    return value


def _as_int(text: Any) -> int:
    value = _as_float(text) if not isinstance(text, bool) else 0.5
    if not value.is_integer():
        raise ValueError("expected an integer")
    return int(value)


MAX_GPU_MEMORY_GIB = 1 << 20  # 1 PiB per GPU: far beyond any device, and int(value * GIB) stays finite


def _gib_to_bytes(text: Any) -> int:
    value = _as_float(text)
    if value > MAX_GPU_MEMORY_GIB:
        raise ValueError(f"expected at most {MAX_GPU_MEMORY_GIB} GiB")
    return int(value * GIB)


# Cluster fields a user may set, with the parser of their value.
CLUSTER_KEYS: dict[str, Callable[[Any], Any]] = {
    "gpus_per_node": _as_int, "n_nodes": _as_int, "intra_node": str, "nics_per_node": _as_int,
    "nic_gbit_per_s": _as_float, "inter_node_oversubscription": _as_float, "nodes_per_leaf": _as_int,
    "gpus_per_pcie_switch": _as_int, "gpus_per_pcie_root": _as_int, "gpus_per_numa_node": _as_int,
    "nvlink_bridge_pairs": _as_bool, "description": str, "name": str, "gpus_per_tray": _as_int,
}
# GPU what-ifs: key -> (GPUSpec field, parser that also converts to the field's unit).
GPU_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "gpu_memory_gib": ("memory_bytes", lambda v: _gib_to_bytes(v)),
    "gpu_memory_gbytes_per_s": ("memory_gbytes_per_s", _as_float),
    "nvlink_gbytes_per_s": ("nvlink_gbytes_per_s", _as_float),
    "nvlink_links": ("nvlink_links", _as_int),
    "pcie_gen": ("pcie_gen", _as_int),
    "pcie_p2p": ("pcie_p2p", _as_bool),
    "xgmi_link_gbytes_per_s": ("xgmi_link_gbytes_per_s", _as_float),
    **{f"gpu_{d}_tflops": (f"{d}_flops", lambda v: _as_float(v) * TFLOPS) for d in ("fp32", "tf32", "bf16", "fp16", "fp8")},
}
SETTABLE_KEYS: tuple[str, ...] = ("gpu", *CLUSTER_KEYS, *GPU_KEYS)
# GPUSpec field -> the unit a --set value is written in (the inverse of GPU_KEYS' parsers)
_GPU_FIELD_UNITS: dict[str, tuple[str, float]] = {
    "memory_bytes": ("gpu_memory_gib", GIB), **{f"{d}_flops": (f"gpu_{d}_tflops", TFLOPS)
                                               for d in ("fp32", "tf32", "bf16", "fp16", "fp8")}}


def gpu_settings(gpu: GPUSpec) -> list[tuple[str, str, str]]:
    """How `gpu` differs from the catalog entry of its name: (--set key, its value, the catalog's), in --set units.

    A plan made with `--set gpu_memory_gib=94` carries the changed GPUSpec;
    this names the change so that `execute` can say what the plan expects.
    Fields no --set key reaches (a hand-edited plan) are named by field. Empty
    for a GPU the catalog does not hold.
    """
    try:
        base = get_gpu(gpu.name)
    except TopologyError:
        return []
    by_field = {field: key for key, (field, _) in GPU_KEYS.items()}
    out = []
    for f in dataclasses.fields(GPUSpec):
        mine, theirs = getattr(gpu, f.name), getattr(base, f.name)
        if mine == theirs:
            continue
        key, scale = _GPU_FIELD_UNITS.get(f.name, (by_field.get(f.name, f.name), 1.0))
        out.append((key, f"{mine / scale:g}" if scale != 1.0 else str(mine),
                    f"{theirs / scale:g}" if scale != 1.0 else str(theirs)))
    return out
MATRIX_KEYS = ("gpu_links", "gpu_nic_links")  # measured label matrices: files only, not --set


def parse_overrides(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` pairs (click's repeatable option) -> {key: value}; later pairs win."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not value.strip():
            raise TopologyError(f"--set {pair!r} must look like KEY=VALUE, e.g. --set nic_gbit_per_s=200")
        out[key] = value.strip()
    return out


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def preset_for_gpu(gpu_name: str) -> str | None:
    """The first preset (by name) built of `gpu_name` GPUs, or None: what to re-plan with for a GPU found."""
    return next((name for name in preset_names() if _read_toml(str(PRESET_DIR / f"{name}.toml")).get("gpu") == gpu_name),
                None)


@lru_cache(maxsize=64)
def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise TopologyError(f"cannot read cluster file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TopologyError(f"cluster file {path} is not UTF-8 text (a binary file?); give a TOML file") from None
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise TopologyError(f"cluster file {path} is not valid TOML: {exc}") from None


def read_cluster_source(name_or_path: str) -> dict[str, Any]:
    """The raw keys of a preset (by name) or a TOML file (by path), plus its name."""
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".toml") or path.is_file():
        data = dict(_read_toml(str(path)))
        data.setdefault("name", path.stem)
        return data
    key = name_or_path.strip().lower()
    names = preset_names()
    if key not in names:
        gpus = {name: str(_read_toml(str(PRESET_DIR / f"{name}.toml")).get("gpu", "")) for name in names}
        raise TopologyError(
            f"unknown cluster {name_or_path!r}{nearest_by_family(key, gpus)}; presets: {', '.join(names)} "
            "(or give the path of a .toml file; `meshplan topo list` shows each preset's GPU)"
        )
    data = dict(_read_toml(str(PRESET_DIR / f"{key}.toml")))
    data.setdefault("name", key)
    return data


def _bad(key: str, value: Any, why: str) -> TopologyError:
    return TopologyError(f"cluster setting {key}={value!r}: {why}")


def _resolve_gpu(data: dict[str, Any]) -> GPUSpec:
    if "gpu" not in data:
        raise TopologyError(f"cluster {data.get('name')!r} names no gpu; add gpu = \"NAME\" (see `meshplan topo list`)")
    gpu = get_gpu(str(data["gpu"]))
    changes = {}
    for key, (field, parse) in GPU_KEYS.items():
        if key in data:
            try:
                changes[field] = parse(data[key])
            except (TypeError, ValueError) as exc:
                raise _bad(key, data[key], str(exc)) from None
    return dataclasses.replace(gpu, **changes) if changes else gpu


def build_cluster(data: dict[str, Any]) -> Cluster:
    """A Cluster from resolved keys (TOML file merged with overrides)."""

    unknown = [k for k in data if k not in SETTABLE_KEYS and k not in MATRIX_KEYS]
    if unknown:
        raise TopologyError(
            f"unknown cluster key {unknown[0]!r}{nearest(unknown[0], SETTABLE_KEYS)}; "
            f"accepted keys: {', '.join(SETTABLE_KEYS)}"
        )
    kwargs: dict[str, Any] = {"gpu": _resolve_gpu(data)}
    for key, parse in CLUSTER_KEYS.items():
        if key in data:
            try:
                kwargs[key] = parse(data[key])
            except (TypeError, ValueError) as exc:
                raise _bad(key, data[key], str(exc)) from None
    for key in MATRIX_KEYS:
        kwargs[key] = tuple(tuple(str(x) for x in row) for row in data.get(key) or ())
    if "gpus_per_node" not in kwargs:
        raise TopologyError(f"cluster {data.get('name')!r} needs gpus_per_node")
    return Cluster(**kwargs)


def load_cluster(name_or_path: str, n_gpus: int | None = None, overrides: dict[str, str] | None = None) -> Cluster:
    """Resolve a preset name or TOML path, apply `--set` overrides, then size it for `--gpus`.

    Overrides come first, so `--set gpus_per_node=4 --gpus 8` gives two nodes
    of four. n_gpus None keeps the file's n_nodes (default one node).
    """
    data = read_cluster_source(name_or_path)
    for key, value in (overrides or {}).items():
        if key not in SETTABLE_KEYS:
            raise TopologyError(
                f"unknown --set key {key!r}{nearest(key, SETTABLE_KEYS)} (value {value!r}); "
                f"accepted keys: {', '.join(SETTABLE_KEYS)}"
            )
        if key == "gpus_per_node" and data.get("gpu_links"):
            raise TopologyError(
                f"--set gpus_per_node={value} on {data['name']!r}: its link matrix is measured for "
                f"{len(data['gpu_links'])} GPUs; use --gpus N to take the first N GPUs"
            )
        if key == "nics_per_node":
            data.pop("gpu_nic_links", None)  # other NICs than the measured ones: place them by rail
        data[key] = value
    cluster = build_cluster(data)
    return cluster if n_gpus is None else cluster.with_gpus(n_gpus)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_cluster_toml(cluster: Cluster, path: str) -> None:
    """Save a cluster as a TOML file `load_cluster(path)` reads back to an equal Cluster (same catalog GPU)."""

    defaults = Cluster(name="x", gpu=cluster.gpu, gpus_per_node=1)
    lines = [f"# {cluster.description or cluster.name}", f"gpu = {_toml_value(cluster.gpu.name)}"]
    base = get_gpu(cluster.gpu.name)
    for key, (field, _) in GPU_KEYS.items():  # the GPU what-ifs it carries, in the unit each key is typed in
        value, catalogued = getattr(cluster.gpu, field), getattr(base, field)
        if value != catalogued:
            typed = value / GIB if key == "gpu_memory_gib" else value / TFLOPS if key.endswith("_tflops") else value
            lines.append(f"{key} = {_toml_value(typed)}")
    for key in CLUSTER_KEYS:
        value = getattr(cluster, key)
        if key in ("name", "gpus_per_node", "description") or value != getattr(defaults, key):
            lines.append(f"{key} = {_toml_value(value)}")
    for key in MATRIX_KEYS:
        rows = getattr(cluster, key)
        if rows:
            lines.append(f"{key} = [")
            lines.extend(f"  {_toml_value(list(row))}," for row in rows)
            lines.append("]")
    from topologies.files import write_text

    write_text(path, "\n".join(lines) + "\n", what="cluster TOML")
