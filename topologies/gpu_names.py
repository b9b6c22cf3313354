"""GPU and cluster names as people type them: product lines, near misses, and what to do about an unknown GPU.

A name's product line is its first model number ('mi300x' and 'AMD Instinct MI300X' are the MI300
line, 'a10g' the A10 line, 'dgx-a100-80g' the A100 line). Near-miss suggestions look in the typed
line before they look at spelling, since the nearest string of another line names another machine.
"""

from __future__ import annotations

import re

from topologies.errors import nearest

# The `--set` keys (topologies.cluster_load.GPU_KEYS) that describe a GPU missing from the catalog
# as a what-if of the nearest one; every "unknown GPU" message names them.
GPU_OVERRIDE_KEYS = ("gpu_memory_gib", "gpu_memory_gbytes_per_s", "gpu_fp32_tflops", "gpu_tf32_tflops",
                     "gpu_bf16_tflops", "gpu_fp16_tflops", "gpu_fp8_tflops", "nvlink_gbytes_per_s", "nvlink_links",
                     "pcie_gen", "pcie_p2p", "xgmi_link_gbytes_per_s")
_FAMILY = re.compile(r"([a-z]*)(\d+)")


def gpu_family(name: str) -> tuple[str, str]:
    """The product line a GPU or cluster name names: the letters and digits of its first model number.

    ('mi', '300') for 'mi300x' and 'AMD Instinct MI300X', ('a', '10') for 'a10g', ('a', '100') for
    'dgx-a100-80g', ('rtx', '4090') for 'rtx4090-pcie', ('', '4090') for 'RTX 4090'; ('', '') when
    the name holds no digits. Words are split at spaces, so 'RTX 4090' keeps its letters apart.
    """
    m = _FAMILY.search(re.sub(r"[\s_]+", "-", name.strip().lower()))
    return (m.group(1), m.group(2)) if m else ("", "")


def same_family(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Equal model numbers whose letters agree, or where one side typed none ('4090' is an 'rtx4090')."""
    return bool(a[1]) and a[1] == b[1] and (a[0] == b[0] or not a[0] or not b[0])


def nearest_by_family(name: str, gpu_of: dict[str, str]) -> str:
    """A ' (did you mean X?)' hint among `gpu_of`'s keys (names, each with the GPU it holds), or ''.

    The product line decides first (planner users type 'mi300x' or 'a10', and the nearest string of
    another line, 'b300' or 'v100', is a different machine): candidates whose own name or GPU is of
    the typed family, the one holding exactly the typed GPU first, then the closest spelling. A typed
    model number that no candidate shares gets only one with the same letters whose number it
    prefixes or extends (a digit dropped or doubled: 'v10', 'dgx-h1000'), never another line ('mi250x'
    is no MI350X); a name without digits the closest spelling (errors.nearest).
    """
    import difflib

    typed = gpu_family(name)
    if not typed[1]:
        return nearest(name, list(gpu_of))
    key = name.strip().lower()
    matches = [c for c, gpu in gpu_of.items() if same_family(typed, gpu_family(c)) or same_family(typed, gpu_family(gpu))]
    if not matches:  # a digit dropped or doubled ('v10', 'dgx-h1000'): same letters, one number prefixing the other
        matches = [c for c in gpu_of if typed[0] and gpu_family(c)[0] == typed[0] and
                   (gpu_family(c)[1].startswith(typed[1]) or typed[1].startswith(gpu_family(c)[1]))]
    if not matches:
        return ""
    best = max(matches, key=lambda c: (gpu_of[c] == key, difflib.SequenceMatcher(None, key, c.lower()).ratio()))
    return f" (did you mean {best!r}?)"


def unknown_gpu_hint() -> str:
    """What to do about a GPU the catalog lacks: the nearest catalogued GPU, with its numbers overridden."""
    return ("; for a GPU not in the catalog, take the nearest one and override its spec-sheet numbers, e.g. "
            "--set gpu=a100-80g-sxm --set gpu_memory_gib=48 --set gpu_bf16_tflops=150 (GPU keys: "
            f"{', '.join(GPU_OVERRIDE_KEYS)}; in a cluster TOML file the same keys)")


__all__ = ["GPU_OVERRIDE_KEYS", "gpu_family", "nearest_by_family", "same_family", "unknown_gpu_hint"]
