"""The uncertainty band of a prediction, from the measured error of the bench that covers it.

`bench/uncertainty_bands.py` runs every accuracy bench's scoring and writes bands.json beside
this file: per engine, GPU family and dense/MoE, the 90th percentile of |step-time error| over
the measured runs (held out of every fit where enough are), with MAPE, bias and the benches it
came from. A plan whose engine, GPU family and kind of model no bench covers is "not
validated": no band is made up for it. plan.json carries the band under
`prediction.uncertainty` (an additive key of schema version 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from planner.figures import percent

BANDS_PATH = Path(__file__).resolve().parent / "bands.json"


def band_family(gpu: str) -> str:
    """The GPU family a band is kept for: the catalog name's first word ('h100' of 'h100-sxm' and 'h100-nvl')."""
    return gpu.lower().split("-")[0]


@dataclass(frozen=True)
class Band:
    engine: str
    gpu_family: str
    moe: bool
    rows: int
    held_out: bool
    p90_abs_error: float
    mape: float
    bias: float
    benches: tuple[str, ...]


@lru_cache(maxsize=1)
def load_bands() -> tuple[Band, ...]:
    doc = json.loads(BANDS_PATH.read_text())
    return tuple(Band(b["engine"], b["gpu_family"], b["moe"], b["rows"], b["held_out"], b["p90_abs_error"],
                      b["mape"], b["bias"], tuple(b["benches"])) for b in doc["bands"])


def band_for(engine: str, gpu: str, moe: bool) -> Band | None:
    """The measured band of this engine on this GPU family for this kind of model, None where no bench covers it."""
    family = band_family(gpu)
    engine = engine.split("@")[0]
    return next((b for b in load_bands() if (b.engine, b.gpu_family, b.moe) == (engine, family, moe)), None)


def uncertainty_json(engine: str, gpu: str, moe: bool) -> dict[str, Any]:
    """plan.json's prediction.uncertainty: the band and where it comes from, or why there is none."""
    band = band_for(engine, gpu, moe)
    kind = "MoE" if moe else "dense"
    if band is None:
        return {"validated": False, "engine": engine, "gpu_family": band_family(gpu), "moe": moe,
                "reason": f"no bench measures engine {engine} on {band_family(gpu)} GPUs with {kind} models"}
    return {"validated": True, "engine": band.engine, "gpu_family": band.gpu_family, "moe": band.moe,
            "band": band.p90_abs_error, "mape": band.mape, "bias": band.bias, "rows": band.rows,
            "held_out": band.held_out, "benches": list(band.benches), "written_by": "bench/uncertainty_bands.py"}


def band_words(engine: str, gpu: str, moe: bool) -> str:
    """' (±8.1%: 90% of 60 measured NeMo runs within it)' or ' (not validated: ...)', for a sentence."""
    band = band_for(engine, gpu, moe)
    if band is None:
        kind = "MoE" if moe else "dense"
        return f" (not validated: no bench measures engine {engine} on {band_family(gpu)} GPUs with {kind} models)"
    runs = "held-out runs" if band.held_out else "runs, fitted ones included"
    share = "90% of" if band.rows >= 10 else "all"  # the 90th percentile of fewer than 10 rows is their worst
    return f" (±{percent(band.p90_abs_error, 2)}: {share} {band.rows} measured {runs} within it)"
